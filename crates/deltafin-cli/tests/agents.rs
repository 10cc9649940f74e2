//! The coding agents people run, against the real `deltafin serve`: Codex CLI (the Responses
//! API), Claude Code (the Messages API) and opencode (chat completions), at the versions
//! pinned in `tools/agents/package.json` (installed by `.ci/run` with
//! `npm ci --prefix tools/agents`). Each runs with its default settings plus the base URL and
//! model docs/AGENTS.md gives: a streamed turn, then a tool-call round trip through a test
//! proxy (`agents/proxy.rs`) whose only change is a forced `tool_choice` on the first
//! request. The server's request log must show no 4xx or 5xx.
//!
//! The checkpoint is `tiny` made to end its answers at once
//! ([`deltafin_k3::synth::answers_end_at_once`]): a random model never ends its message, and
//! an agent needs finished answers. Where a forced call forbids ending, every marker closes
//! as soon as it may, so the call is complete within a few tokens.
//!
//! Without the agents installed (or Node.js) each test prints a SKIP line;
//! `DELTAFIN_REQUIRE_AGENTS=1` (set by CI) makes that a failure.

mod common;
#[path = "agents/proxy.rs"]
mod proxy;

use deltafin_k3::synth::{SynthDims, SynthSpec, answers_end_at_once, synthesize};
use proxy::{Force, Proxy};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The longest one agent run may take.
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// Where the agents are: `DELTAFIN_AGENTS_DIR`, else `tools/agents` of this tree.
fn agents_dir() -> PathBuf {
    std::env::var_os("DELTAFIN_AGENTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/agents"))
}

/// Where `npm ci --prefix tools/agents --ignore-scripts` puts each agent's executable: the
/// Linux x86-64 native packages of Claude Code and opencode (their wrapper packages need an
/// install script to put the binary in place), and Codex's Node.js launcher.
fn agent_path(name: &str) -> PathBuf {
    let modules = agents_dir().join("node_modules");
    match name {
        "claude" => modules.join("@anthropic-ai/claude-code-linux-x64/claude"),
        "opencode" => modules.join("opencode-linux-x64/bin/opencode"),
        _ => modules.join(".bin").join(name),
    }
}

/// The agent's executable, or why it cannot run (a SKIP line, or a failure under
/// `DELTAFIN_REQUIRE_AGENTS=1`).
fn agent(name: &str) -> Option<PathBuf> {
    let bin = agent_path(name);
    let runs = Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if runs {
        return Some(bin);
    }
    let why = format!(
        "{name} does not run from {} (is Node.js installed?): run `npm ci --prefix tools/agents --ignore-scripts`",
        bin.display()
    );
    if std::env::var("DELTAFIN_REQUIRE_AGENTS").as_deref() == Ok("1") {
        panic!("DELTAFIN_REQUIRE_AGENTS=1: {why}");
    }
    eprintln!("SKIP: {why}");
    None
}

/// The test checkpoint, synthesized once.
fn checkpoint() -> &'static Path {
    static CELL: OnceLock<tempfile::TempDir> = OnceLock::new();
    CELL.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 7)).unwrap();
        deltafin_k3::synth::remove_at_exit(d.path());
        answers_end_at_once(d.path()).unwrap();
        d
    })
    .path()
}

/// A running `deltafin serve` with the settings docs/AGENTS.md gives agent users.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(root: &Path) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
        cmd.env("K3_SPINE", "bf16");
        for k in [
            "DELTAFIN_API_KEY",
            "K3_SERVER_QUEUE",
            "K3_REASONING_EFFORT",
            "K3_MEMORY_BUDGET_GB",
        ] {
            cmd.env_remove(k);
        }
        cmd.args(["serve", "--port", "0", "--model-root"])
            .arg(root)
            .stderr(Stdio::piped())
            .stdout(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut startup = Vec::new();
        let addr: SocketAddr = loop {
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
        let log = Arc::new(Mutex::new(startup));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let s = Server { child, addr, log };
        s.wait_ready();
        s
    }

    fn wait_ready(&self) {
        let until = Instant::now() + Duration::from_secs(120);
        while Instant::now() < until {
            if self.lines().iter().any(|l| l.contains("model ready")) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the model did not load: {:?}", self.lines());
    }

    fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// The request log lines (`status=…`).
    fn requests(&self) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.contains("] request id="))
            .collect()
    }

    /// Asserts that every logged request was answered 2xx, and that some were.
    #[track_caller]
    fn no_refusals(&self, what: &str) -> Vec<String> {
        let reqs = self.requests();
        let bad: Vec<&String> = reqs
            .iter()
            .filter(|l| !l.contains("status=200") && !l.contains("status=204"))
            .collect();
        assert!(
            bad.is_empty(),
            "{what}: refused requests {bad:#?}\nall: {reqs:#?}"
        );
        assert!(
            !reqs.is_empty(),
            "{what}: no request reached the server: {:?}",
            self.lines()
        );
        reqs
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cmd` with a time limit; its output.
fn run(mut cmd: Command) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let done = Arc::new(Mutex::new(false));
    let flag = done.clone();
    std::thread::spawn(move || {
        let until = Instant::now() + RUN_LIMIT;
        while Instant::now() < until {
            if *flag.lock().unwrap() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // SAFETY: kill(2) on the child's pid; no memory is touched.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let out = child.wait_with_output().unwrap();
    *done.lock().unwrap() = true;
    out
}

/// An empty home for one agent run (agents write their settings and sessions there).
fn home() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

// ---- Codex CLI ------------------------------------------------------------------------------

fn codex(bin: &Path, base: SocketAddr, prompt: &str) -> Output {
    let h = home();
    let codex_home = h.path().join(".codex");
    std::fs::create_dir_all(&codex_home).unwrap();
    // docs/AGENTS.md, "Codex CLI".
    std::fs::write(
        codex_home.join("config.toml"),
        format!(
            "model = \"deltafin-kimi-k3\"\nmodel_provider = \"deltafin\"\n\n[model_providers.deltafin]\nname = \"deltafin\"\nbase_url = \"http://{base}/v1\"\nwire_api = \"responses\"\n"
        ),
    )
    .unwrap();
    let mut cmd = Command::new(bin);
    cmd.env("HOME", h.path())
        .env("CODEX_HOME", &codex_home)
        .current_dir(h.path())
        .args(["exec", "--skip-git-repo-check", prompt]);
    run(cmd)
}

#[test]
fn codex_completes_a_turn_and_a_tool_round_trip() {
    let Some(bin) = agent("codex") else { return };
    let server = Server::start(checkpoint());
    let o = codex(&bin, server.addr, "say hi");
    assert!(o.status.success(), "codex turn: {}", show(&o));
    server.no_refusals("codex turn");

    let proxy = Proxy::start(server.addr, Force::Responses, &["get_goal"]);
    let o = codex(&bin, proxy.addr, "what is the goal?");
    let seen = proxy.seen.lock().unwrap().clone();
    assert!(
        o.status.success(),
        "codex tool turn: {}\nrequests: {seen:#?}",
        show(&o)
    );
    server.no_refusals("codex tool round trip");
    let forced = seen
        .iter()
        .find_map(|s| s.forced.clone())
        .expect("a call was forced");
    // The call came back as its output in a later request.
    let answered = seen.iter().any(|s| {
        s.body
            .as_ref()
            .and_then(|b| b["input"].as_array())
            .is_some_and(|items| {
                items
                    .iter()
                    .any(|i| i["type"] == "function_call" && i["name"] == forced.as_str())
                    && items.iter().any(|i| i["type"] == "function_call_output")
            })
    });
    assert!(
        answered,
        "codex sent no result of its {forced} call: {seen:#?}"
    );
}

// ---- Claude Code ----------------------------------------------------------------------------

fn claude(bin: &Path, base: SocketAddr, prompt: &str) -> Output {
    let h = home();
    let mut cmd = Command::new(bin);
    // docs/AGENTS.md, "Claude Code".
    cmd.env("HOME", h.path())
        .env("ANTHROPIC_BASE_URL", format!("http://{base}"))
        .env("ANTHROPIC_API_KEY", "sk-local")
        .env("ANTHROPIC_MODEL", "deltafin-kimi-k3")
        .current_dir(h.path())
        .args(["-p", "--", prompt]);
    run(cmd)
}

#[test]
fn claude_code_completes_a_turn_and_a_tool_round_trip() {
    let Some(bin) = agent("claude") else { return };
    let server = Server::start(checkpoint());
    let o = claude(&bin, server.addr, "say hi");
    assert!(o.status.success(), "claude turn: {}", show(&o));
    server.no_refusals("claude turn");

    let proxy = Proxy::start(server.addr, Force::Messages, &["ListAgents", "Read"]);
    let o = claude(&bin, proxy.addr, "list the agents");
    let seen = proxy.seen.lock().unwrap().clone();
    assert!(
        o.status.success(),
        "claude tool turn: {}\nrequests: {seen:#?}",
        show(&o)
    );
    server.no_refusals("claude tool round trip");
    let forced = seen
        .iter()
        .find_map(|s| s.forced.clone())
        .expect("a call was forced");
    let answered = seen.iter().any(|s| {
        s.body
            .as_ref()
            .and_then(|b| b["messages"].as_array())
            .is_some_and(|msgs| {
                msgs.iter().any(|m| {
                    m["content"]
                        .as_array()
                        .is_some_and(|blocks| blocks.iter().any(|b| b["type"] == "tool_result"))
                })
            })
    });
    assert!(
        answered,
        "claude sent no result of its {forced} call: {seen:#?}"
    );
}

// ---- opencode -------------------------------------------------------------------------------

fn opencode(bin: &Path, base: SocketAddr, prompt: &str) -> Output {
    let h = home();
    let config = h.path().join(".config/opencode");
    std::fs::create_dir_all(&config).unwrap();
    // docs/AGENTS.md, "opencode".
    std::fs::write(
        config.join("opencode.json"),
        format!(
            r#"{{"$schema": "https://opencode.ai/config.json",
  "provider": {{"deltafin": {{"npm": "@ai-sdk/openai-compatible", "name": "deltafin",
    "options": {{"baseURL": "http://{base}/v1", "apiKey": "sk-local"}},
    "models": {{"deltafin-kimi-k3": {{"name": "Kimi K3 (deltafin)"}}}}}}}},
  "model": "deltafin/deltafin-kimi-k3"}}"#
        ),
    )
    .unwrap();
    let mut cmd = Command::new(bin);
    cmd.env("HOME", h.path())
        .env("XDG_CONFIG_HOME", h.path().join(".config"))
        .env("XDG_DATA_HOME", h.path().join(".local/share"))
        .env("XDG_CACHE_HOME", h.path().join(".cache"))
        .env("XDG_STATE_HOME", h.path().join(".local/state"))
        .current_dir(h.path())
        .args(["run", prompt]);
    run(cmd)
}

#[test]
fn opencode_completes_a_turn_and_a_tool_round_trip() {
    let Some(bin) = agent("opencode") else { return };
    let server = Server::start(checkpoint());
    let o = opencode(&bin, server.addr, "say hi");
    assert!(o.status.success(), "opencode turn: {}", show(&o));
    // Its title request runs beside the turn: it waits in the queue, never a 429.
    let reqs = server.no_refusals("opencode turn");
    assert!(
        reqs.len() >= 2,
        "opencode sent its title and its turn: {reqs:#?}"
    );

    let proxy = Proxy::start(server.addr, Force::Chat, &["read", "glob"]);
    let o = opencode(&bin, proxy.addr, "read a file");
    let seen = proxy.seen.lock().unwrap().clone();
    assert!(
        o.status.success(),
        "opencode tool turn: {}\nrequests: {seen:#?}",
        show(&o)
    );
    server.no_refusals("opencode tool round trip");
    let forced = seen
        .iter()
        .find_map(|s| s.forced.clone())
        .expect("a call was forced");
    let answered = seen.iter().any(|s| {
        s.body
            .as_ref()
            .and_then(|b| b["messages"].as_array())
            .is_some_and(|msgs| msgs.iter().any(|m| m["role"] == "tool"))
    });
    assert!(
        answered,
        "opencode sent no result of its {forced} call: {seen:#?}"
    );
}
