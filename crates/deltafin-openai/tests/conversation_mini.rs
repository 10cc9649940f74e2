//! Time to first token of a second chat turn on `mini` with and without stored prefix
//! states, through the server (recorded in docs/PERFORMANCE.md, "Conversation state"), and
//! the disk tier's write and read speed against the disk.
//!
//! A measurement (`#[ignore]`) that needs the checkpoint: set `DELTAFIN_MINI` to its root
//! (`cargo xtask synth --preset mini --seed 1 --out /work/mini-k3`); the state files go to a
//! temporary directory beside it. Run in a release build:
//!
//! ```text
//! DELTAFIN_MINI=/work/mini-k3 cargo test --release -p deltafin-openai \
//!     --test conversation_mini -- --ignored --nocapture --test-threads 1
//! ```
//!
//! One sitting, A B B A: a cold server (no cache) answers turn 2; a cached server answers
//! turn 1 then turn 2 (RAM tier); a restarted cached server over the same directory, with the
//! state files dropped from the page cache, answers turn 2 (disk tier); then the same in the
//! reverse order. TTFT is the time from the request to its first content frame (thinking
//! off, streamed).

mod common;

use common::*;
use deltafin_experts::DirectIo;
use deltafin_experts::probe::{ProbeOptions, probe};
use deltafin_k3::engine::EngineConfig;
use deltafin_k3::prefix::{CacheConfig, PrefixCache};
use deltafin_openai::Engine;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn mini_root() -> PathBuf {
    match std::env::var_os("DELTAFIN_MINI") {
        Some(p) => PathBuf::from(p),
        None => panic!("set DELTAFIN_MINI to the mini checkpoint root (e.g. /work/mini-k3)"),
    }
}

fn load(root: &Path, states: Option<&Path>) -> Result<Engine, String> {
    let e = Engine::load_with(root, &EngineConfig::default())
        .map_err(|e| e.to_string())?
        .with_memo(0, 0);
    let Some(dir) = states else { return Ok(e) };
    let config = CacheConfig {
        ram_bytes: 4_000_000_000,
        disk: Some((dir.to_path_buf(), 16_000_000_000)),
    };
    let cache = PrefixCache::new(&e.model, "mini", &config, Box::new(|m| eprintln!("{m}")))?;
    Ok(e.with_state_cache(cache))
}

fn server(root: &Path, states: Option<&Path>) -> TestServer {
    let (root, states) = (root.to_path_buf(), states.map(Path::to_path_buf));
    let s = TestServer::start_with(any_port(), move || load(&root, states.as_deref()));
    s.wait_ready();
    s
}

fn turn1() -> Vec<Value> {
    let system: String = (0..90)
        .map(|i| format!("Rule {i}: the assistant answers briefly, exactly and politely."))
        .collect::<Vec<_>>()
        .join(" ");
    vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Which river flows through Paris?"}),
    ]
}

fn turn2() -> Vec<Value> {
    let mut m = turn1();
    m.push(json!({"role": "assistant", "content": "The Seine flows through Paris."}));
    let more: String = (0..12)
        .map(|i| format!("Point {i}: tell me one more fact about it."))
        .collect::<Vec<_>>()
        .join(" ");
    m.push(json!({"role": "user", "content": more}));
    m
}

/// Seconds to the first content frame, and the prompt's token count.
fn ttft(s: &TestServer, messages: &[Value]) -> (f64, u64) {
    let body = json!({"messages": messages, "max_tokens": 2, "reasoning_effort": "none",
                      "stream": true, "stream_options": {"include_usage": true}});
    let t = Instant::now();
    let mut c = connect(s.addr);
    c.write_all(&request_bytes(
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
        &[],
    ))
    .unwrap();
    let mut r = BufReader::new(c);
    let mut line = String::new();
    let mut first = None;
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream closed early");
        let Some(payload) = line.strip_prefix("data: ") else {
            continue;
        };
        if payload.starts_with("[DONE]") {
            panic!("no usage frame");
        }
        let v: Value = serde_json::from_str(payload.trim()).unwrap();
        if first.is_none()
            && v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
        {
            first = Some(t.elapsed().as_secs_f64());
        }
        if let Some(n) = v["usage"]["prompt_tokens"].as_u64() {
            return (first.unwrap_or_else(|| t.elapsed().as_secs_f64()), n);
        }
    }
}

/// Drop `dir`'s files from the page cache (a restarted server on a cold disk).
fn evict(dir: &Path) {
    use std::os::fd::AsRawFd;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if let Ok(f) = std::fs::File::open(e.path()) {
            let _ = f.sync_all();
            // SAFETY: a valid descriptor; the call only advises the kernel.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

#[test]
#[ignore = "measurement on the mini checkpoint: set DELTAFIN_MINI, run in release"]
fn second_turn_ttft_on_mini() {
    let root = mini_root();
    let parent = root.parent().unwrap_or(Path::new("/tmp")).to_path_buf();
    let (mut cold, mut ram, mut disk) = (Vec::new(), Vec::new(), Vec::new());
    let (mut n1, mut n2, mut reused) = (0, 0, 0.0);
    let reused_of = |s: &TestServer| -> f64 {
        let m = String::from_utf8(get(s.addr, "/metrics").body).unwrap();
        m.lines()
            .find_map(|l| l.strip_prefix("deltafin_prefix_reused_tokens_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap()
    };
    for rep in 0..2 {
        let order: [u8; 3] = if rep == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for arm in order {
            let states = tempfile::tempdir_in(&parent).unwrap();
            match arm {
                // Cold: no prefix states.
                0 => {
                    let s = server(&root, None);
                    let (t, n) = ttft(&s, &turn2());
                    cold.push(t);
                    n2 = n;
                }
                // RAM tier: turn 1, then turn 2 on the same server.
                1 => {
                    let s = server(&root, Some(states.path()));
                    n1 = ttft(&s, &turn1()).1;
                    ram.push(ttft(&s, &turn2()).0);
                    reused = reused_of(&s);
                }
                // Disk tier: turn 1, a restart with the state files out of the page
                // cache, turn 2.
                _ => {
                    {
                        let s = server(&root, Some(states.path()));
                        ttft(&s, &turn1());
                    }
                    evict(states.path());
                    let s = server(&root, Some(states.path()));
                    disk.push(ttft(&s, &turn2()).0);
                    assert!(reused_of(&s) > 0.0);
                }
            }
        }
    }
    println!("turn 1: {n1} tokens, turn 2: {n2} tokens");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (c, r, d) = (mean(&cold), mean(&ram), mean(&disk));
    let ideal = (n2 as f64 - reused) / n2 as f64;
    println!("cold TTFT {cold:?} s, RAM tier {ram:?} s, disk tier {disk:?} s");
    println!(
        "turn 2: {reused} of {n2} tokens reused; new/total {ideal:.3}; TTFT ratio RAM {:.3}, disk {:.3}",
        r / c,
        d / c
    );
}

#[test]
#[ignore = "measurement on the mini checkpoint: set DELTAFIN_MINI, run in release"]
fn snapshot_write_and_read_speed_on_mini() {
    let root = mini_root();
    let parent = root.parent().unwrap_or(Path::new("/tmp")).to_path_buf();
    let engine = load(&root, None).unwrap();
    let tok = engine.tokenizer.clone();
    let text: String = (0..400).map(|i| format!("word{i} ")).collect();
    let ids = tok.encode_ordinary(&text);
    let states = tempfile::tempdir_in(&parent).unwrap();
    let config = CacheConfig {
        ram_bytes: 0,
        disk: Some((states.path().to_path_buf(), 16_000_000_000)),
    };
    let cache = PrefixCache::new(
        &engine.model,
        "mini",
        &config,
        Box::new(|m| eprintln!("{m}")),
    )
    .unwrap();
    // The state at the prompt's last usable 64-token boundary.
    let at = deltafin_k3::prefix::prefill::last_snapshot_position(ids.len(), 64);
    let mut s = engine.model.new_state();
    engine
        .model
        .forward(&mut s, &ids[..at], deltafin_k3::model::LogitRows::None)
        .unwrap();
    let snap = deltafin_k3::prefix::Snapshot {
        state: s,
        taps: None,
    };
    let mut writes = Vec::new();
    let mut reads = Vec::new();
    let mut raw = Vec::new();
    let mut bytes = 0u64;
    for rep in 0..4 {
        for e in std::fs::read_dir(states.path()).unwrap().flatten() {
            std::fs::remove_file(e.path()).unwrap();
        }
        let t = Instant::now();
        assert!(cache.store(&ids[..at], snap.clone()));
        let w = t.elapsed().as_secs_f64();
        bytes = std::fs::read_dir(states.path())
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .sum();
        evict(states.path());
        let t = Instant::now();
        let (len, _) = cache.lookup(&ids, at, None).unwrap();
        let r = t.elapsed().as_secs_f64();
        assert_eq!(len, at);
        // The same bytes written raw (write + fsync), the disk's own write speed.
        let path = states.path().join("raw.bin");
        let buf = vec![7u8; bytes as usize];
        let t = Instant::now();
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&buf).unwrap();
        f.sync_all().unwrap();
        let rw = t.elapsed().as_secs_f64();
        std::fs::remove_file(&path).unwrap();
        if rep % 2 == 0 {
            writes.push(w);
            reads.push(r);
            raw.push(rw);
        } else {
            raw.push(rw);
            writes.push(w);
            reads.push(r);
        }
    }
    let shard = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .unwrap();
    let pr = probe(
        &shard,
        &ProbeOptions {
            sequential_bytes: 1_000_000_000,
            sequential_chunk: 16 << 20,
            random_size: 1 << 20,
            random_count: 0,
            threads: 4,
            direct_io: DirectIo::Auto,
            seed: 1,
        },
    )
    .unwrap();
    let gbps = |s: &[f64]| bytes as f64 / (s.iter().sum::<f64>() / s.len() as f64) / 1e9;
    println!(
        "snapshot of {at} positions: {bytes} bytes; write {:.2} GB/s (raw write+fsync {:.2} GB/s), read (cold, checked) {:.2} GB/s; disk probe sequential read {:.2} GB/s ({})",
        gbps(&writes),
        gbps(&raw),
        gbps(&reads),
        pr.sequential_gbps,
        pr.io_path
    );
}
