//! The setup family end to end: the real `deltafin` binary against an in-process mock hub.

mod common;

use common::text;

use deltafin_fetch::mock_hub::{Fault, MockHub};
use deltafin_fetch::synth_source::{SynthSource, small_dims};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    c.env_remove("DELTAFIN_ROOT")
        .env_remove("DELTAFIN_MANIFESTS")
        .env_remove("HF_TOKEN");
    c
}

struct Env {
    tmp: tempfile::TempDir,
    src: SynthSource,
    hub: MockHub,
}

fn env() -> Env {
    env_with(small_dims())
}

/// Small dims with the real vocabulary, so that the real tokenizer fits and `run` works.
fn runnable_env() -> Env {
    let mut d = small_dims();
    d.vocab = deltafin_k3::synth::SynthDims::tiny().vocab;
    env_with(d)
}

fn env_with(dims: deltafin_k3::synth::SynthDims) -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let src = SynthSource::create(&tmp.path().join("src"), dims, 11).unwrap();
    src.manifests
        .write_dir(&tmp.path().join("manifests"))
        .unwrap();
    let hub = MockHub::start().unwrap();
    src.serve(&hub).unwrap();
    Env { tmp, src, hub }
}

impl Env {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = bin();
        c.args(args)
            .env("HF_ENDPOINT", self.hub.url())
            // The mock hub speaks plain HTTP on loopback.
            .env("DELTAFIN_INSECURE_HTTP", "1")
            .env("DELTAFIN_MANIFESTS", self.tmp.path().join("manifests"))
            .env("DELTAFIN_ROOT", self.root());
        c
    }
    fn root(&self) -> std::path::PathBuf {
        self.tmp.path().join("root")
    }
    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }
}

#[test]
fn dry_run_makes_no_requests_and_no_writes() {
    let e = env();
    for args in [
        &["setup", "--dry-run"][..],
        &["setup", "--dry-run", "--stream", "--include-qwen"],
        &["fetch-weights", "--dry-run", "--layers", "1-3,5"],
    ] {
        let o = e.run(args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("dry run"), "{}", text(&o));
    }
    assert!(e.hub.requests().is_empty(), "{:?}", e.hub.requests());
    assert!(!e.root().exists(), "dry run created the model root");
}

/// The decimal GB of a size text (`16.26 GB`, `59.8 MB`, `3.1 kB`, `53 B`).
fn gb_of(text: &str) -> f64 {
    let (n, unit) = text.trim().trim_start_matches('≈').split_once(' ').unwrap();
    let n: f64 = n.parse().unwrap();
    n * match unit {
        "GB" => 1.0,
        "MB" => 1e-3,
        "kB" => 1e-6,
        "B" => 1e-9,
        other => panic!("unit {other:?} in {text:?}"),
    }
}

#[test]
fn real_manifest_dry_run_adds_up_to_the_index_total() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("r");
    let o = bin()
        .args(["setup", "--dry-run", "--full", "--model-root"])
        .arg(&root)
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("DELTAFIN_INSECURE_HTTP", "1")
        .env("DELTAFIN_TEST_FREE_DISK_BYTES", "2000000000000")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let data: Vec<f64> = t
        .lines()
        .filter(|l| l.starts_with("weights"))
        .map(|l| gb_of(l.rsplit("data=").next().unwrap()))
        .collect();
    assert_eq!(data.len(), 96, "{t}");
    // Each line is rounded to 10 MB.
    let sum: f64 = data.iter().sum();
    assert!((sum - 1560.860).abs() < 96.0 * 0.005, "{sum}");
    assert!(t.contains("weight tensor data: 1560.86 GB"), "{t}");
    assert!(t.contains("peak additional disk: ≈"), "{t}");
    assert!(
        t.contains("free disk: 2000.00 GB\ndisk: the plan fits"),
        "{t}"
    );
    // Sizes are for people: no raw byte counts.
    assert!(
        !t.split_whitespace()
            .any(|w| w.len() > 4 && w.chars().all(|c| c.is_ascii_digit())),
        "{t}"
    );
    // The int8 spine of the released configuration is exact, and said once.
    let int8: Vec<&str> = t.lines().filter(|l| l.contains("int8")).collect();
    assert_eq!(int8.len(), 2, "{int8:?}");
    assert!(
        int8[0].starts_with("int8      k3-resident-int8/tensors/"),
        "{int8:?}"
    );
    assert!(
        int8[1].starts_with("row-int8 spine: 54.98 GB written after the weights"),
        "{int8:?}"
    );
    assert!(!root.exists());
}

#[test]
fn dry_run_says_the_int8_spine_once_and_what_setup_will_do() {
    let e = env();
    let o = e.run(&["setup", "--dry-run", "--stream"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(!t.contains("not available"), "{t}");
    assert!(!t.contains("then:"), "{t}");
    let int8: Vec<&str> = t.lines().filter(|l| l.contains("int8")).collect();
    assert_eq!(int8.len(), 3, "{int8:?}");
    assert!(int8[0].starts_with("int8      "), "{int8:?}");
    assert!(int8[1].starts_with("row-int8 spine: ≈"), "{int8:?}");
    assert!(
        int8[2].starts_with("note: ≈ the row-int8 spine is estimated"),
        "{int8:?}"
    );
    assert!(t.contains("disk: the plan fits"), "{t}");
    assert!(e.hub.requests().is_empty());
}

#[test]
fn setup_refuses_before_writing_when_the_disk_is_too_small() {
    use deltafin_fetch::plan::{Mode, plan_setup, size_text};
    let e = env();
    let need = |mode| plan_setup(&e.root(), &e.src.manifests, mode, false).peak_additional_bytes();
    let (full, stream) = (need(Mode::Full), need(Mode::Stream));
    assert!(stream < full);
    // Room for a stream install only: `--full` is refused with both numbers and the hint.
    let free = stream.to_string();
    let o = e
        .cmd(&["setup", "--full"])
        .env("DELTAFIN_TEST_FREE_DISK_BYTES", &free)
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains(&format!(
            "not enough disk at {}: a full setup needs ",
            e.root().display()
        )),
        "{t}"
    );
    assert!(t.contains(&format!("{} more (", size_text(full))), "{t}");
    assert!(
        t.contains(&format!("only {} are free", size_text(stream))),
        "{t}"
    );
    assert!(
        t.contains(&format!(
            "`deltafin setup --stream` needs {}",
            size_text(stream)
        )),
        "{t}"
    );
    // Too little for either: refused, and nothing was fetched or written.
    for args in [&["setup"][..], &["setup", "--stream"]] {
        let o = e
            .cmd(args)
            .env("DELTAFIN_TEST_FREE_DISK_BYTES", "1000")
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{t}");
        assert!(t.contains("a stream setup needs "), "{t}");
        assert!(t.contains("only 1.0 kB are free"), "{t}");
    }
    // The dry run says the same, and exits 1.
    let o = e
        .cmd(&["setup", "--dry-run"])
        .env("DELTAFIN_TEST_FREE_DISK_BYTES", "1000")
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("disk: setup would refuse: not enough disk at "),
        "{t}"
    );
    assert!(e.hub.requests().is_empty(), "{:?}", e.hub.requests());
    assert!(!e.root().exists(), "a refused setup wrote the model root");
    // A bad test value is an error naming the variable.
    let o = e
        .cmd(&["setup", "--dry-run"])
        .env("DELTAFIN_TEST_FREE_DISK_BYTES", "lots")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("DELTAFIN_TEST_FREE_DISK_BYTES"),
        "{}",
        text(&o)
    );
}

#[test]
fn strict_flags() {
    for args in [
        &["setup", "--full", "--stream"][..],
        &["setup", "--dry-run", "--check"],
        &["setup", "--workers", "0"],
        &["setup", "--workers", "17"],
        &["setup", "--workers", "8x"],
        &["setup-k3"],
        &["setup-k3", "--meta-only", "--check"],
        &["setup-dspark", "--check", "--audit-only"],
        &["fetch-weights", "--spine-only", "--experts-only"],
        &["fetch-weights", "--dry-run", "--layers", "0-3"],
        &["fetch-weights", "--dry-run", "--layers", "1,2"],
        &["fetch-weights", "--dry-run", "--layers", "93"],
    ] {
        let o = bin().args(args).output().unwrap();
        assert!(!o.status.success(), "{args:?} accepted: {}", text(&o));
    }
}

fn same_tree(e: &Env) {
    let m = &e.src.manifests;
    for s in &m.k3.shards {
        assert!(
            std::fs::read(e.root().join(&s.file)).unwrap()
                == std::fs::read(e.src.k3_dir.join(&s.file)).unwrap(),
            "{}",
            s.file
        );
    }
}

fn parts(d: &Path) -> usize {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(d) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                n += parts(&p);
            } else if p.to_string_lossy().ends_with(".part") {
                n += 1;
            }
        }
    }
    n
}

#[test]
fn killed_at_random_points_resumes_and_finishes() {
    let e = env();
    // Metadata and inventory first, so that the kills land in the shard transfers.
    let o = e.run(&["setup-k3", "--meta-only"]);
    assert!(o.status.success(), "{}", text(&o));
    e.hub
        .add_fault("model-", Fault::Slow(Duration::from_millis(30)), u32::MAX);
    let t0 = Instant::now();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("kill-point seed {seed}");
    let (mut kills, mut parts_seen) = (0, 0);
    for _ in 0..60 {
        if kills >= 20 {
            break;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_millis(15 + seed % 76);
        let mut child = e
            .cmd(&["setup", "--full", "--workers", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        match child.try_wait().unwrap() {
            Some(st) => assert!(st.success(), "a run failed on its own"),
            None => {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
                parts_seen += parts(&e.root());
            }
        }
    }
    eprintln!(
        "{kills} kills, {parts_seen} .part files seen after kills, {:?}",
        t0.elapsed()
    );
    assert!(
        kills >= 20,
        "only {kills} kills landed before the install finished"
    );
    assert!(parts_seen > 0, "no kill interrupted a transfer");
    e.hub.clear_faults();
    let o = e.run(&["setup", "--full"]);
    assert!(o.status.success(), "{}", text(&o));
    same_tree(&e);
    assert_eq!(parts(&e.root()), 0);
    let o = e.run(&["setup", "--check"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn stream_setup_check_and_layer_fetch() {
    let e = env();
    let o = e.run(&["setup", "--stream", "--include-qwen"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(!t.contains("not available"), "{t}");
    assert!(t.contains("converting the row-int8 spine"), "{t}");
    assert!(t.contains("setup complete (stream install)\n"), "{t}");
    assert!(e.root().join("k3-resident-int8/tensors").is_dir());
    // Everything is in place: the plan has nothing left to fetch or convert.
    let o = e.run(&["setup", "--dry-run", "--stream", "--include-qwen"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("peak additional disk: 0 B\n"), "{t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("int8      ") && l.ends_with(" (present)")),
        "{t}"
    );
    let o = e.run(&["setup", "--check", "--include-qwen"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("lazy-missing="), "{}", text(&o));
    let o = e.run(&["fetch-weights", "--layers", "2-3"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(e.root().join("k3-experts/L3-E15.bin").exists());
    let o = e.run(&["setup-k3", "--check"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = e.run(&["setup-dspark", "--audit-only"]);
    assert!(o.status.success(), "{}", text(&o));
    // A missing spine file and a corrupted metadata file are both reported.
    let spine = e.root().join("k3-resident/tensors");
    let victim = std::fs::read_dir(&spine)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::remove_file(&victim).unwrap();
    let cfg = e.root().join("config.json");
    let mut b = std::fs::read(&cfg).unwrap();
    b[10] ^= 0x20;
    std::fs::write(&cfg, b).unwrap();
    // A fetched expert changed in place (same size) fails its fetch receipt's sha256.
    let expert = e.root().join("k3-experts/L3-E15.bin");
    let mut b = std::fs::read(&expert).unwrap();
    b[7] ^= 0x01;
    std::fs::write(&expert, b).unwrap();
    let o = e.run(&["setup", "--check"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.lines().any(|l| l.starts_with("corrupted")
            && l.contains("L3-E15.bin")
            && l.contains("sha256")),
        "{t}"
    );
    assert!(
        t.contains("missing") && t.contains(&*victim.file_name().unwrap().to_string_lossy()),
        "{t}"
    );
    assert!(t.contains("corrupted") && t.contains("config.json"), "{t}");
}

/// `deltafin run --spine bf16` on `root` (drafters off through `--top-logits`): the events.
fn run_ids(e: &Env, root: &Path, endpoint: Option<&str>) -> (Output, Vec<u64>) {
    run_ids_with(e, root, endpoint, &[])
}

fn run_ids_with(
    e: &Env,
    root: &Path,
    endpoint: Option<&str>,
    extra: &[&str],
) -> (Output, Vec<u64>) {
    let ev = e.tmp.path().join("events.jsonl");
    let _ = std::fs::remove_file(&ev);
    let mut c = e.cmd(&[
        "run",
        "--spine",
        "bf16",
        "--max-new",
        "6",
        "--top-logits",
        "1",
        "--events-jsonl",
        ev.to_str().unwrap(),
        "--model-root",
        root.to_str().unwrap(),
    ]);
    c.args(extra);
    if let Some(url) = endpoint {
        c.env("HF_ENDPOINT", url).env("DELTAFIN_INSECURE_HTTP", "1");
    }
    let o = c.env_remove("K3_SPINE").output().unwrap();
    if !o.status.success() {
        return (o, Vec::new());
    }
    let text = std::fs::read_to_string(&ev).unwrap();
    let end: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["event"] == "run_end")
        .unwrap();
    let ids = end["emitted_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    (o, ids)
}

fn expert_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(root.join("k3-experts"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn stream_install_runs_like_the_shards_and_fetches_experts_once() {
    use std::os::unix::fs::FileExt;
    let e = runnable_env();
    let o = e.run(&["setup", "--stream"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        expert_files(&e.root()).is_empty(),
        "setup --stream fetched experts"
    );

    let (o, want) = run_ids(&e, &e.src.k3_dir, None);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("layout=shards"), "{}", text(&o));
    assert_eq!(want.len(), 6);

    e.hub.clear_log();
    let (o, got) = run_ids(&e, &e.root(), None);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("layout=stream-install"), "{}", text(&o));
    assert_eq!(got, want, "stream install and shards disagree");
    let fetched = expert_files(&e.root());
    assert!(!fetched.is_empty(), "no expert was fetched");
    let reqs = e.hub.requests();
    assert!(
        reqs.iter().all(|r| r.contains("model-")),
        "requests other than shard ranges: {reqs:?}"
    );
    assert!(reqs.len() >= fetched.len(), "{reqs:?}");

    // Every fetched expert equals the source shards' bytes of its six tensors.
    let src = deltafin_k3::weights::checkpoint::Checkpoint::open(&e.src.k3_dir).unwrap();
    for path in &fetched {
        let name = path.file_name().unwrap().to_str().unwrap();
        let (l, x) = name
            .trim_start_matches('L')
            .trim_end_matches(".bin")
            .split_once("-E")
            .unwrap();
        let span = src
            .expert_span(l.parse().unwrap(), x.parse().unwrap())
            .unwrap();
        let f = std::fs::File::open(&span.shard_path).unwrap();
        let mut want = Vec::new();
        for (off, len) in span.ranges {
            let mut b = vec![0u8; len as usize];
            f.read_exact_at(&mut b, off).unwrap();
            want.extend_from_slice(&b);
        }
        assert!(std::fs::read(path).unwrap() == want, "{name} differs");
    }

    // A second run fetches nothing.
    e.hub.clear_log();
    let (o, again) = run_ids(&e, &e.root(), None);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(again, want);
    assert!(e.hub.requests().is_empty(), "{:?}", e.hub.requests());
    assert_eq!(expert_files(&e.root()), fetched);

    // Offline with a needed expert missing: the error names the layer, the expert and the
    // hub's error.
    let victim = &fetched[0];
    let name = victim.file_name().unwrap().to_str().unwrap().to_string();
    let (l, x) = name
        .trim_start_matches('L')
        .trim_end_matches(".bin")
        .split_once("-E")
        .unwrap();
    std::fs::remove_file(victim).unwrap();
    let (o, _) = run_ids(&e, &e.root(), Some("http://127.0.0.1:9"));
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains(&format!("expert {x} of layer {l}")), "{t}");
    assert!(t.contains("fetching it from the hub failed"), "{t}");

    // Under a memory budget (streaming experts) the missing expert is fetched again and the
    // tokens are the same.
    e.hub.clear_log();
    let (o, budget) = run_ids_with(&e, &e.root(), None, &["--memory-budget-gb", "4"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("memory budget"), "{}", text(&o));
    assert_eq!(budget, want);
    assert!(victim.is_file());
    assert!(!e.hub.requests().is_empty());
}

#[test]
fn stream_install_spine_errors_name_the_tensor() {
    let e = runnable_env();
    let o = e.run(&["setup", "--stream"]);
    assert!(o.status.success(), "{}", text(&o));
    let dir = e.root().join("k3-resident/tensors");
    let name = "language_model.model.layers.1.self_attn.q_proj.weight";
    let path = dir.join(name);
    let bytes = std::fs::read(&path).unwrap();

    // Wrong size.
    std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
    let (o, _) = run_ids(&e, &e.root(), None);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains(name) && t.contains("bytes, expected"), "{t}");

    // Missing.
    std::fs::remove_file(&path).unwrap();
    let (o, _) = run_ids(&e, &e.root(), None);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains(name) && t.contains("is missing"), "{t}");

    // Restored: it runs.
    std::fs::write(&path, &bytes).unwrap();
    let (o, ids) = run_ids(&e, &e.root(), None);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(ids.len(), 6);
}

#[test]
fn plain_http_hubs_need_insecure_http() {
    let env = env();
    // Without the flag or the variable: refused before any transfer, naming the way out.
    let o = env
        .cmd(&["setup-k3", "--meta-only"])
        .env_remove("DELTAFIN_INSECURE_HTTP")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("plain http://") && t.contains("--insecure-http"),
        "{t}"
    );
    assert!(!env.root().join("config.json").exists());
    // A bad value of the variable is named.
    let o = env
        .cmd(&["setup-k3", "--meta-only"])
        .env("DELTAFIN_INSECURE_HTTP", "yes")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains("DELTAFIN_INSECURE_HTTP"),
        "{t}"
    );
    // The flag allows it.
    let o = env
        .cmd(&["setup-k3", "--meta-only", "--insecure-http"])
        .env_remove("DELTAFIN_INSECURE_HTTP")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn installers_and_expert_fetches_take_the_install_lock() {
    use deltafin_fetch::lock::{lock_expert, lock_install};
    let e = runnable_env();
    let o = e.run(&["setup", "--stream"]);
    assert!(o.status.success(), "{}", text(&o));
    let lock_file = e.root().join("k3-meta/install.lock");
    assert!(lock_file.is_file());

    // Another installer holds the root: every installer is refused before it writes,
    // naming the holder and the lock file, and so is the on-demand expert fetch of `run`.
    let held = lock_install(&e.root(), "deltafin test-holder", Duration::ZERO).unwrap();
    e.hub.clear_log();
    for args in [
        &["setup", "--stream"][..],
        &["setup-k3", "--meta-only"],
        &["setup-qwen"],
        &["fetch-weights", "--layers", "2"],
    ] {
        let o = e.run(args);
        let t = text(&o);
        assert!(!o.status.success(), "{args:?}: {t}");
        assert!(
            t.contains("`deltafin test-holder` (pid ") && t.contains("install.lock"),
            "{args:?}: {t}"
        );
    }
    assert!(e.hub.requests().is_empty(), "{:?}", e.hub.requests());
    assert!(expert_files(&e.root()).is_empty());
    let (o, _) = run_ids(&e, &e.root(), None);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("is installing into it"), "{t}");
    assert!(expert_files(&e.root()).is_empty());
    drop(held);

    // A fetch of one expert in flight (its byte held) delays an installer until it ends.
    let one = lock_expert(&e.root(), 2 * 16 + 3, Duration::ZERO).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        drop(one);
    });
    let t0 = Instant::now();
    let o = e.run(&["fetch-weights", "--layers", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(t0.elapsed() >= Duration::from_secs(1), "did not wait");
    release.join().unwrap();
    assert!(e.root().join("k3-experts/L2-E15.bin").is_file());
    // With the root free again, `run` fetches what it needs.
    let (o, ids) = run_ids(&e, &e.root(), None);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(ids.len(), 6);
}

/// `setup --from-hf-cache` (docs/SETUP.md "Existing downloads"): the whole release in a fake
/// Hugging Face cache (the default location under `HF_HOME`) installs without a K3 request,
/// hard-linked and verified, the int8 spine converted, `--check` clean; a damaged blob is
/// refused by name.
#[test]
fn setup_from_hf_cache_links_verified_files() {
    let e = env();
    let hf_home = e.tmp.path().join("hf");
    e.src.hf_cache(&hf_home.join("hub"), &[]).unwrap();
    let plan = e
        .cmd(&["setup", "--dry-run", "--full", "--from-hf-cache"])
        .env("HF_HOME", &hf_home)
        .output()
        .unwrap();
    assert!(plan.status.success(), "{}", text(&plan));
    assert!(
        text(&plan).contains("hard-linked from the Hugging Face cache"),
        "{}",
        text(&plan)
    );
    let o = e
        .cmd(&["setup", "--full", "--from-hf-cache"])
        .env("HF_HOME", &hf_home)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("hard-linked"), "{}", text(&o));
    assert!(
        e.hub.requests().iter().all(|r| !r.contains("/cdn/")),
        "{:?}",
        e.hub.requests()
    );
    let c = e.run(&["setup", "--check"]);
    assert!(c.status.success(), "{}", text(&c));

    // A damaged blob in a fresh install: refused, naming the file.
    let shard = &e.src.manifests.k3.shards[0].file;
    let snap = hf_home
        .join("hub/models--synth--Kimi-K3/snapshots")
        .join(deltafin_fetch::synth_source::K3_COMMIT);
    let blob = std::fs::canonicalize(snap.join(shard)).unwrap();
    std::fs::remove_dir_all(e.root()).unwrap();
    let mut b = std::fs::read(&blob).unwrap();
    let n = b.len();
    b[n - 1] ^= 1;
    std::fs::write(&blob, b).unwrap();
    let o = e
        .cmd(&[
            "setup",
            "--full",
            "--from-hf-cache",
            hf_home.join("hub").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o).contains(shard.as_str()) && text(&o).contains("Hugging Face cache"),
        "{}",
        text(&o)
    );
    assert!(!e.root().join(shard).exists());
}
