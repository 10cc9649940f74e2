//! Installs from an in-process mock hub serving a synthesized K3 source, with faults.

use deltafin_fetch::FetchError;
use deltafin_fetch::check::check_k3;
use deltafin_fetch::expert::{ExpertFetch, RemoteExperts};
use deltafin_fetch::hub::{HubClient, Scheme};
use deltafin_fetch::inventory::Inventory;
use deltafin_fetch::manifest::Manifests;
use deltafin_fetch::mock_hub::{Fault, MockHub};
use deltafin_fetch::plan::{Mode, SPINE_DIR, Selection, plan_setup};
use deltafin_fetch::setup::{Setup, check_setup};
use deltafin_fetch::synth_source::{SynthSource, small_dims};
use deltafin_fetch::transfer::{RetryPolicy, TransferOptions};
use std::path::Path;
use std::time::Duration;

fn fast() -> TransferOptions {
    TransferOptions {
        workers: 4,
        retry: RetryPolicy {
            attempts: 4,
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(20),
        },
        progress: false,
        ..TransferOptions::default()
    }
}

struct Env {
    _tmp: tempfile::TempDir,
    src: SynthSource,
    hub: MockHub,
    client: HubClient,
    root: std::path::PathBuf,
}

fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let src = SynthSource::create(&tmp.path().join("src"), small_dims(), 7).unwrap();
    let hub = MockHub::start().unwrap();
    src.serve(&hub).unwrap();
    let client =
        HubClient::new(&hub.url(), Some("secret-token".into()), Scheme::AllowHttp).unwrap();
    let root = tmp.path().join("root");
    Env {
        _tmp: tmp,
        src,
        hub,
        client,
        root,
    }
}

fn setup<'a>(e: &'a Env, ms: &'a Manifests) -> Setup<'a> {
    Setup {
        root: e.root.clone(),
        manifests: ms,
        client: &e.client,
        transfer: fast(),
        hf_cache: None,
    }
}

fn same(a: &Path, b: &Path) {
    assert!(
        std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
        "{} differs from {}",
        a.display(),
        b.display()
    );
}

#[test]
fn full_install_is_byte_identical_and_check_finds_damage() {
    let e = env();
    let ms = &e.src.manifests;
    setup(&e, ms).run(Mode::Full, true, &mut |_| {}).unwrap();
    for s in &ms.k3.shards {
        same(&e.root.join(&s.file), &e.src.k3_dir.join(&s.file));
    }
    for f in &ms.k3.metadata {
        same(&e.root.join(&f.path), &e.src.k3_dir.join(&f.path));
    }
    assert!(check_setup(&e.root, ms, Mode::Full, true).is_ok());
    // Nothing left half-written.
    let parts = walk(&e.root)
        .into_iter()
        .filter(|p| p.ends_with(".part"))
        .count();
    assert_eq!(parts, 0);
    // Rerun: everything is already complete, no data requests.
    e.hub.clear_log();
    setup(&e, ms).run(Mode::Full, true, &mut |_| {}).unwrap();
    assert!(
        e.hub.requests().iter().all(|r| !r.contains("/cdn/")),
        "{:?}",
        e.hub.requests()
    );

    // A corrupted byte (same size) and a missing file.
    let shard = e.root.join(&ms.k3.shards[2].file);
    let mut b = std::fs::read(&shard).unwrap();
    let n = b.len();
    b[n / 2] ^= 1;
    std::fs::write(&shard, b).unwrap();
    std::fs::remove_file(e.root.join("k3-draft-dspark/config.json")).unwrap();
    let r = check_setup(&e.root, ms, Mode::Full, false);
    assert_eq!(r.problems.len(), 2, "{:?}", r.problems);
    assert!(
        r.problems
            .iter()
            .any(|p| p.starts_with("corrupted") && p.contains(&ms.k3.shards[2].file))
    );
    assert!(
        r.problems
            .iter()
            .any(|p| p.starts_with("missing") && p.contains("k3-draft-dspark/config.json"))
    );
}

fn walk(d: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

#[test]
fn stream_install_spine_and_on_demand_experts_are_byte_identical() {
    let e = env();
    let ms = &e.src.manifests;
    setup(&e, ms).run(Mode::Stream, false, &mut |_| {}).unwrap();
    let inv = Inventory::load(&e.root, &ms.k3.inventory).unwrap();
    let mut n = 0;
    for r in inv.records().iter().filter(|r| !r.is_expert()) {
        let src = std::fs::read(e.src.k3_dir.join(&r.shard)).unwrap();
        let (a, b) = r.file_range();
        let got = std::fs::read(e.root.join(SPINE_DIR).join(&r.name)).unwrap();
        assert!(got == src[a as usize..b as usize], "{}", r.name);
        n += 1;
    }
    assert!(n > 50);
    // No shard and no expert was downloaded.
    assert!(!e.root.join(&ms.k3.shards[1].file).exists());
    let r = check_k3(&e.root, &ms.k3, Mode::Stream);
    assert!(r.is_ok(), "{:?}", r.problems);
    let total = (ms.k3.moe_layers().len() * ms.k3.experts_per_layer) as u64;
    assert_eq!(r.lazy_missing, Some(total));

    // On-demand experts: exact byte ranges, cached, identical to the shard bytes.
    let fetcher = RemoteExperts::open(&e.root, &ms.k3, e.client.clone()).unwrap();
    for (l, x) in [(1, 0), (1, 10), (5, 15), (3, 7)] {
        let p = fetcher.fetch_expert(l, x).unwrap();
        let (shard, off, len) = fetcher.span(l, x).unwrap();
        let src = std::fs::read(e.src.k3_dir.join(shard)).unwrap();
        assert!(std::fs::read(&p).unwrap() == src[off as usize..(off + len) as usize]);
    }
    e.hub.clear_log();
    fetcher.fetch_expert(1, 10).unwrap();
    assert!(e.hub.requests().is_empty(), "cached expert refetched");
    assert!(fetcher.fetch_expert(1, 16).is_err());
    assert!(fetcher.fetch_expert(0, 0).is_err(), "layer 0 is dense");
    let r = check_k3(&e.root, &ms.k3, Mode::Stream);
    assert_eq!(r.lazy_missing, Some(total - 4));

    // fetch-weights --layers 2: every expert of layer 2.
    let s = setup(&e, ms);
    s.weights(&inv, &Selection::Experts(vec![2]), &mut |_| {})
        .unwrap();
    for x in 0..ms.k3.experts_per_layer {
        let (shard, off, len) = fetcher.span(2, x).unwrap();
        let src = std::fs::read(e.src.k3_dir.join(shard)).unwrap();
        let got = std::fs::read(e.root.join(format!("k3-experts/L2-E{x}.bin"))).unwrap();
        assert!(got == src[off as usize..(off + len) as usize]);
    }

    // Every fetched weight file has a receipt, and the check re-hashes against it: a flipped
    // byte in an expert or a spine tensor (same size) is found, and so is a file of the
    // right size that no fetch wrote.
    let r = check_k3(&e.root, &ms.k3, Mode::Stream);
    assert!(r.is_ok(), "{:?}", r.problems);
    let flip = |p: &Path| {
        let mut b = std::fs::read(p).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 1;
        std::fs::write(p, b).unwrap();
    };
    let expert = e.root.join("k3-experts/L2-E5.bin");
    flip(&expert);
    let spine = inv.records().iter().find(|r| !r.is_expert()).unwrap();
    let spine = e.root.join(SPINE_DIR).join(&spine.name);
    flip(&spine);
    let foreign = e.root.join("k3-experts/L4-E1.bin");
    std::fs::write(&foreign, vec![0u8; ms.k3.expert_bytes as usize]).unwrap();
    let r = check_k3(&e.root, &ms.k3, Mode::Stream);
    let has = |what: &str, p: &Path| {
        r.problems
            .iter()
            .any(|x| x.starts_with(what) && x.contains(&*p.display().to_string()))
    };
    assert!(has("corrupted", &expert), "{:?}", r.problems);
    assert!(has("corrupted", &spine), "{:?}", r.problems);
    assert!(has("unverifiable", &foreign), "{:?}", r.problems);
    assert_eq!(r.problems.len(), 3, "{:?}", r.problems);
}

#[test]
fn transient_faults_are_survived() {
    let e = env();
    let ms = &e.src.manifests;
    let big = ms.k3.shards[1].file.clone();
    // Metadata and inventory first, so the faults hit the shard payloads.
    setup(&e, ms).k3_meta(&mut |_| {}).unwrap();
    e.hub.add_fault(&big, Fault::DropAfter(1000), 3);
    e.hub.add_fault("model-00003", Fault::Status(500), 2);
    e.hub.add_fault("model-00004", Fault::Status(503), 1);
    e.hub.add_fault("model-00005", Fault::Corrupt(100), 1);
    e.hub.add_fault(
        "model-00006",
        Fault::Slow(Duration::from_millis(2)),
        u32::MAX,
    );
    setup(&e, ms).run(Mode::Full, false, &mut |_| {}).unwrap();
    for s in &ms.k3.shards {
        same(&e.root.join(&s.file), &e.src.k3_dir.join(&s.file));
    }
    // The dropped shard resumed with range requests from its .part length.
    let resumes = e
        .hub
        .requests()
        .iter()
        .filter(|r| r.contains("/cdn/") && r.contains(&big) && !r.contains("bytes=0-"))
        .count();
    assert!(resumes >= 3, "{:?}", e.hub.requests());
}

fn first_error(e: &Env, root: &str, fault: Fault, file: &str, times: u32) -> FetchError {
    let ms = &e.src.manifests;
    let mut s = setup(e, ms);
    s.root = e.root.join(root);
    if file.starts_with("model-") {
        s.k3_meta(&mut |_| {}).unwrap();
    }
    e.hub.add_fault(file, fault, times);
    let err = s.run(Mode::Full, false, &mut |_| {}).unwrap_err();
    e.hub.clear_faults();
    err
}

#[test]
fn persistent_corruption_is_a_clear_error() {
    let e = env();
    let f = e.src.manifests.k3.shards[3].file.clone();
    let err = first_error(&e, "a", Fault::Corrupt(50), &f, u32::MAX);
    assert!(
        matches!(err, FetchError::Sha256 { attempts: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&f));
    // Nothing under the final name, and no .part kept for the bad file.
    assert!(!e.root.join("a").join(&f).exists());
}

#[test]
fn wrong_commit_404_and_persistent_500_fail_cleanly() {
    let e = env();
    let err = first_error(&e, "a", Fault::WrongCommit, "config.json", 1);
    assert!(matches!(err, FetchError::CommitMismatch { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(deltafin_fetch::synth_source::K3_COMMIT)
    );
    assert!(!e.root.join("a/config.json").exists());
    let err = first_error(&e, "b", Fault::Status(404), "tiktoken.model", 1);
    assert!(matches!(err, FetchError::NotFound { .. }), "{err}");
    let err = first_error(&e, "c", Fault::Status(500), "tokenizer_config", u32::MAX);
    assert!(matches!(err, FetchError::Http { status: 500, .. }), "{err}");
    // The token is never part of an error or the log.
    assert!(!err.to_string().contains("secret-token"));
    setup(&e, &e.src.manifests)
        .run(Mode::Full, false, &mut |_| {})
        .unwrap();
}

/// Root bypasses permission bits: as root, the test reruns itself in a child process as the
/// unprivileged uid/gid 65534 (`nobody`) and passes when the child passes.
fn rerun_unprivileged(test: &str) {
    use std::os::unix::process::CommandExt;
    assert!(
        std::env::var_os("DELTAFIN_TEST_UNPRIVILEGED").is_none(),
        "{test}: the rerun as uid 65534 still runs as root"
    );
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(&exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("DELTAFIN_TEST_UNPRIVILEGED", "1")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap_or_else(|e| panic!("{test}: cannot rerun {} as uid 65534: {e}", exe.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} as uid 65534:\n{text}"
    );
}

#[test]
fn permission_denied_stops_cleanly() {
    use std::os::unix::fs::PermissionsExt;
    if nix::unistd::Uid::effective().is_root() {
        return rerun_unprivileged("permission_denied_stops_cleanly");
    }
    let e = env();
    std::fs::create_dir_all(&e.root).unwrap();
    std::fs::set_permissions(&e.root, std::fs::Permissions::from_mode(0o555)).unwrap();
    let err = setup(&e, &e.src.manifests)
        .run(Mode::Full, false, &mut |_| {})
        .unwrap_err();
    std::fs::set_permissions(&e.root, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(matches!(err, FetchError::Io { .. }), "{err}");
}

#[test]
fn dry_run_plan_of_the_real_manifest_adds_up() {
    let ms = Manifests::builtin().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let full = plan_setup(tmp.path(), &ms, Mode::Full, false);
    assert_eq!(full.weight_data_bytes(), 1_560_860_324_864);
    assert_eq!(
        full.items.iter().filter(|i| i.step == "weights").count(),
        96
    );
    assert!(!full.exact(), "real shard headers are not pinned");
    let stream = plan_setup(tmp.path(), &ms, Mode::Stream, true);
    assert_eq!(stream.weight_data_bytes(), 114_404_258_816);
    assert!(stream.exact());
    // Both end with the row-int8 spine of the released configuration, written locally: in
    // the peak disk use, not in the download.
    let int8 = stream.convert_bytes();
    assert_eq!(int8, full.convert_bytes());
    assert!(
        int8 > 50_000_000_000 && int8 < 114_404_258_816 / 2,
        "{int8}"
    );
    assert_eq!(
        stream.peak_additional_bytes(),
        stream.download_bytes() + int8
    );
    assert!(full.convert_exact() && !full.download_exact());
    assert!(walk(tmp.path()).is_empty(), "a plan wrote files");
}

/// Power loss during a download, simulated on the `.part` a cut transfer left: bytes past
/// the last resume point were never synced, so they may read back as zeros or garbage (or
/// the disk may lie about synced ones). Whatever is left, the resumed file that is
/// published equals the source: unpinned files (as experts and spine tensors are) included.
#[test]
fn power_loss_before_a_resume_never_publishes_a_corrupt_file() {
    use deltafin_fetch::transfer::{Job, part_path, resume_path, run_jobs};
    let e = env();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("blob.bin");
    let data: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    e.hub
        .add_file("org/blob", "c0ffee", "blob.bin", &src)
        .unwrap();
    let dest = tmp.path().join("out").join("blob.bin");
    let job = Job {
        repo: "org/blob".into(),
        revision: "c0ffee".into(),
        file: "blob.bin".into(),
        range: None,
        dest: dest.clone(),
        size: data.len() as u64,
        sha256: None,
    };
    let opts = |attempts| TransferOptions {
        workers: 1,
        retry: RetryPolicy {
            attempts,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
        },
        progress: false,
        checkpoint_bytes: 256 * 1024,
        receipts: None,
        local: None,
    };
    type Damage = fn(&Path, u64);
    let damages: [(&str, Damage); 5] = [
        ("zeros past the resume point", |p, _| {
            let mut b = std::fs::read(p).unwrap();
            b.extend(std::iter::repeat_n(0u8, 700_000));
            std::fs::write(p, b).unwrap();
        }),
        ("garbage over the unsynced tail", |p, _| {
            let mut b = std::fs::read(p).unwrap();
            b.extend(std::iter::repeat_n(0xA5u8, 123_457));
            std::fs::write(p, b).unwrap();
        }),
        ("a synced tail that reads back as zeros", |p, len| {
            let mut b = std::fs::read(p).unwrap();
            let at = (len - 10_000) as usize;
            b[at..at + 4096].fill(0);
            std::fs::write(p, b).unwrap();
        }),
        ("a .part shorter than its record", |p, len| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(len - 1)
                .unwrap();
        }),
        ("a damaged record", |p, _| {
            let r = {
                let mut s = p.as_os_str().to_os_string();
                s.push(".resume");
                std::path::PathBuf::from(s)
            };
            let mut b = std::fs::read(&r).unwrap();
            b[10] ^= 1;
            std::fs::write(&r, b).unwrap();
        }),
    ];
    for (what, damage) in damages {
        let _ = std::fs::remove_file(&dest);
        // Cut after ~1.1 MB: the transfer ends with a resume point there.
        e.hub.add_fault("blob.bin", Fault::DropAfter(1_100_000), 1);
        let err = run_jobs(&e.client, std::slice::from_ref(&job), &opts(1));
        assert!(err.is_err(), "{what}: the cut transfer must fail");
        let part = part_path(&dest);
        assert!(resume_path(&dest).exists(), "{what}: no resume point");
        let len = std::fs::metadata(&part).unwrap().len();
        assert!(len > 0, "{what}");
        damage(&part, len);
        run_jobs(&e.client, std::slice::from_ref(&job), &opts(4))
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        assert!(
            std::fs::read(&dest).unwrap() == data,
            "{what}: the published file differs from the source"
        );
        assert!(!part.exists() && !resume_path(&dest).exists(), "{what}");
    }
}

/// Existing downloads (docs/SETUP.md): the K3 repository in a fake Hugging Face cache
/// (snapshot symlinks to blobs named by their SHA-256), the shards unpinned as in the real
/// release. Cached files are hard-linked, verified and given receipts; only what the cache
/// lacks is fetched.
#[test]
fn hf_cache_full_install_links_cached_files_and_fetches_only_the_rest() {
    use deltafin_fetch::hf_cache::HfCache;
    use std::os::unix::fs::MetadataExt;
    use std::sync::Arc;
    let e = env();
    let mut ms = e.src.manifests.clone();
    for s in &mut ms.k3.shards {
        s.sha256 = None;
    }
    let hub_dir = e._tmp.path().join("hf/hub");
    let snaps = e.src.hf_cache(&hub_dir, &[ms.k3.repo.as_str()]).unwrap();
    assert_eq!(snaps.len(), 1);
    // One shard the user never downloaded.
    let missing = ms.k3.shards[1].file.clone();
    std::fs::remove_file(snaps[0].join(&missing)).unwrap();
    let cache = Arc::new(HfCache::open(&hub_dir, &ms).unwrap());
    let s = setup(&e, &ms).with_hf_cache(Some(cache.clone()));
    let mut lines = Vec::new();
    s.run(Mode::Full, false, &mut |l| lines.push(l.to_string()))
        .unwrap();
    for sh in &ms.k3.shards {
        same(&e.root.join(&sh.file), &e.src.k3_dir.join(&sh.file));
    }
    // Hard links into the cache's blobs, not copies.
    let shard0 = &ms.k3.shards[0].file;
    let blob = std::fs::canonicalize(snaps[0].join(shard0)).unwrap();
    assert_eq!(
        std::fs::metadata(e.root.join(shard0)).unwrap().ino(),
        std::fs::metadata(&blob).unwrap().ino()
    );
    // The hub was asked for the missing shard (its header, then its bytes) and DSpark only:
    // no K3 metadata, no other shard or shard header.
    let reqs = e.hub.requests();
    let k3_reqs: Vec<&String> = reqs.iter().filter(|r| r.contains("Kimi-K3")).collect();
    assert!(!k3_reqs.is_empty());
    assert!(k3_reqs.iter().all(|r| r.contains(&missing)), "{k3_reqs:?}");
    assert!(reqs.iter().any(|r| r.contains("DSpark")));
    let used = cache.used();
    let k3_files = ms.k3.metadata.len() + ms.k3.shards.len() - 1;
    assert_eq!(used.linked, k3_files, "{used:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("from the Hugging Face cache")),
        "{lines:?}"
    );
    // Unpinned shards from the cache got receipts: the check verifies them.
    let r = check_setup(&e.root, &ms, Mode::Full, false);
    assert!(r.is_ok(), "{:?}", r.problems);
    // A rerun fetches nothing.
    e.hub.clear_log();
    setup(&e, &ms).run(Mode::Full, false, &mut |_| {}).unwrap();
    assert!(
        e.hub.requests().iter().all(|r| !r.contains("/cdn/")),
        "{:?}",
        e.hub.requests()
    );
}

/// A cached file whose bytes do not match (a damaged blob; a pinned file that differs) is
/// refused with an error naming it, and nothing is installed from it.
#[test]
fn hf_cache_mismatching_files_are_refused_by_name() {
    use deltafin_fetch::hf_cache::HfCache;
    use std::sync::Arc;
    let e = env();
    let mut ms = e.src.manifests.clone();
    for s in &mut ms.k3.shards {
        s.sha256 = None;
    }
    let hub_dir = e._tmp.path().join("hf/hub");
    let snaps = e.src.hf_cache(&hub_dir, &[]).unwrap();
    assert_eq!(snaps.len(), 4, "K3, DSpark and the two Qwen repositories");
    let k3_snap = snaps
        .iter()
        .find(|p| p.to_string_lossy().contains("Kimi-K3"))
        .unwrap()
        .clone();
    // A flipped byte in an (unpinned) shard's blob: it no longer hashes to its blob name.
    let bad = ms.k3.shards[2].file.clone();
    let blob = std::fs::canonicalize(k3_snap.join(&bad)).unwrap();
    let mut b = std::fs::read(&blob).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x40;
    std::fs::write(&blob, b).unwrap();
    let run = |ms: &Manifests| {
        let mut s =
            setup(&e, ms).with_hf_cache(Some(Arc::new(HfCache::open(&hub_dir, ms).unwrap())));
        s.transfer.workers = 1;
        s.run(Mode::Full, false, &mut |_| {})
    };
    let err = run(&ms).unwrap_err();
    assert!(matches!(err, FetchError::Cache(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&bad) && msg.contains("blob name"), "{msg}");
    assert!(!e.root.join(&bad).exists());
    assert!(!e.root.join(format!("{bad}.part")).exists());
    // The hub was never asked for it either.
    assert!(e.hub.requests().iter().all(|r| !r.contains(&bad)));

    // A pinned file whose cached bytes differ from the pin (here: the pin changed).
    let mut ms2 = e.src.manifests.clone();
    let cfg = ms2
        .dspark
        .files
        .iter_mut()
        .find(|f| f.path == "config.json")
        .unwrap();
    cfg.sha256 = Some("0".repeat(64));
    std::fs::write(&blob, std::fs::read(e.src.k3_dir.join(&bad)).unwrap()).unwrap();
    std::fs::remove_dir_all(e.root.join(&ms2.dspark.install_dir)).unwrap();
    let err = run(&ms2).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("config.json") && msg.contains("K3-DSpark") && msg.contains("pinned"),
        "{msg}"
    );
}

/// A stream install copies the spine tensors' byte ranges out of the cached shards: no
/// shard byte is requested from the hub.
#[test]
fn hf_cache_stream_install_copies_ranges_from_cached_shards() {
    use deltafin_fetch::hf_cache::HfCache;
    use std::sync::Arc;
    let e = env();
    let ms = &e.src.manifests;
    let hub_dir = e._tmp.path().join("hf/hub");
    e.src.hf_cache(&hub_dir, &[ms.k3.repo.as_str()]).unwrap();
    let s = setup(&e, ms).with_hf_cache(Some(Arc::new(HfCache::open(&hub_dir, ms).unwrap())));
    s.run(Mode::Stream, false, &mut |_| {}).unwrap();
    let inv = Inventory::load(&e.root, &ms.k3.inventory).unwrap();
    for r in inv.records().iter().filter(|r| !r.is_expert()) {
        let src = std::fs::read(e.src.k3_dir.join(&r.shard)).unwrap();
        let (a, b) = r.file_range();
        let got = std::fs::read(e.root.join(SPINE_DIR).join(&r.name)).unwrap();
        assert!(got == src[a as usize..b as usize], "{}", r.name);
    }
    assert!(
        e.hub.requests().iter().all(|r| !r.contains("Kimi-K3")),
        "{:?}",
        e.hub.requests()
    );
    let r = check_k3(&e.root, &ms.k3, Mode::Stream);
    assert!(r.is_ok(), "{:?}", r.problems);
}

/// The directory given may be the hub cache, a repository's directory or a snapshot; a
/// snapshot of another revision, or of a repository that is not pinned, is refused.
#[test]
fn hf_cache_directory_forms_and_wrong_revisions() {
    use deltafin_fetch::hf_cache::HfCache;
    let e = env();
    let ms = &e.src.manifests;
    let hub_dir = e._tmp.path().join("hf/hub");
    let snaps = e.src.hf_cache(&hub_dir, &[ms.k3.repo.as_str()]).unwrap();
    let repo_dir = snaps[0].parent().unwrap().parent().unwrap().to_path_buf();
    for d in [&hub_dir, &repo_dir, &snaps[0]] {
        let c = HfCache::open(d, ms).unwrap();
        assert_eq!(c.hub_dir(), hub_dir.as_path(), "{}", d.display());
        assert!(
            c.lookup(&ms.k3.repo, &ms.k3.revision, "config.json")
                .is_some()
        );
    }
    let other = repo_dir.join("snapshots").join("9".repeat(40));
    std::fs::create_dir_all(&other).unwrap();
    let err = HfCache::open(&other, ms).unwrap_err().to_string();
    assert!(
        err.contains(&ms.k3.revision) && err.contains("pinned revision"),
        "{err}"
    );
    let stranger = hub_dir.join("models--someone--else");
    std::fs::create_dir_all(&stranger).unwrap();
    let err = HfCache::open(&stranger, ms).unwrap_err().to_string();
    assert!(err.contains("none of the pinned repositories"), "{err}");
    let err = HfCache::open(&hub_dir.join("nope"), ms)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope"), "{err}");
}
