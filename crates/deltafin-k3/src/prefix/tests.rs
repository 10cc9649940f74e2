//! Exactness, tiers, damage and cancellation of the prefix-state cache on the tiny random
//! model (KDA chunk 64, 14 layers with MLA and KDA, two AttnRes blocks).

use super::cache::{CacheConfig, PrefixCache};
use super::prefill::{Chunked, OnePass, PrefillProgress, Prefilled, Prefiller};
use crate::model::forward::tests::random_model;
use crate::model::{K3Model, LogitRows};
use crate::test_util::Rng;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..n).map(|_| (r.next_u64() % 300) as u32).collect()
}

fn cold(model: &K3Model, p: &[u32]) -> Prefilled {
    OnePass.prefill(model, p, None).unwrap().unwrap()
}

fn ram_cache(model: &K3Model, bytes: u64) -> PrefixCache {
    let config = CacheConfig {
        ram_bytes: bytes,
        disk: None,
    };
    PrefixCache::new(model, "test", &config, Box::new(|_| {})).unwrap()
}

type Warnings = Arc<Mutex<Vec<String>>>;

fn disk_cache(model: &K3Model, dir: &std::path::Path, tag: &str) -> (PrefixCache, Warnings) {
    disk_cache_of(model, dir, tag, 1 << 30)
}

fn disk_cache_of(
    model: &K3Model,
    dir: &std::path::Path,
    tag: &str,
    budget: u64,
) -> (PrefixCache, Warnings) {
    let warnings: Warnings = Default::default();
    let w = warnings.clone();
    let config = CacheConfig {
        ram_bytes: 0,
        disk: Some((dir.to_path_buf(), budget)),
    };
    let sink = Box::new(move |m: &str| w.lock().unwrap().push(m.to_string()));
    (
        PrefixCache::new(model, tag, &config, sink).unwrap(),
        warnings,
    )
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn aligned_passes_give_the_one_pass_bits() {
    let (model, _) = random_model(11);
    for n in [1, 2, 63, 64, 65, 66, 127, 129, 200] {
        let p = prompt(n as u64, n);
        let want = cold(&model, &p);
        for chunk in [64, 128, 4096] {
            let mut c = Chunked::new(None);
            c.chunk = chunk;
            let got = c.prefill(&model, &p, None).unwrap().unwrap();
            assert_eq!(bits(&got.logits), bits(&want.logits), "n={n} chunk={chunk}");
            assert_eq!(got.state, want.state, "n={n} chunk={chunk}");
        }
    }
    // The control: passes split off the KDA chunk grid do change the bits, so the test
    // above can tell.
    let p = prompt(200, 200);
    let mut state = model.new_state();
    model
        .forward(&mut state, &p[..100], LogitRows::None)
        .unwrap();
    let split = model
        .forward(&mut state, &p[100..], LogitRows::Last)
        .unwrap();
    assert_ne!(bits(&split.values), bits(&cold(&model, &p).logits));
}

#[test]
fn a_resumed_prefill_gives_the_cold_bits_at_every_boundary() {
    let (model, _) = random_model(12);
    let cache = ram_cache(&model, 1 << 30);
    let turn1 = prompt(1, 150);
    let mut c = Chunked::new(Some(&cache));
    c.marks = vec![70, 140];
    let first = c.prefill(&model, &turn1, None).unwrap().unwrap();
    assert_eq!(first.reused, 0);
    assert_eq!(bits(&first.logits), bits(&cold(&model, &turn1).logits));
    // Snapshots at 64 (the last mark before the end, rounded down) and 128 (the last
    // usable position) were stored.
    assert_eq!(first.stored, 2);
    // Extensions reuse the longest stored prefix: across the KDA chunk boundary at 128, at
    // 64, and with a one-row and a two-row tail.
    for (extra, diverge_at, reused) in [
        (80, None, 128),
        (1, None, 128),
        (0, Some(100), 64),
        (0, Some(63), 0),
    ] {
        let mut p = turn1.clone();
        p.extend(prompt(99, extra));
        if let Some(at) = diverge_at {
            p[at] = (p[at] + 1) % 300;
        }
        let mut c = Chunked::new(Some(&cache));
        let got = c.prefill(&model, &p, None).unwrap().unwrap();
        assert_eq!(got.reused, reused, "extra={extra} diverge={diverge_at:?}");
        let want = cold(&model, &p);
        assert_eq!(bits(&got.logits), bits(&want.logits), "extra={extra}");
        assert_eq!(got.state, want.state);
    }
    // A prompt that is the stored prefix plus one token cannot take it (a one-row pass
    // would run the recurrent form): it takes the one before.
    let p = turn1[..129].to_vec();
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &p, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 64);
    assert_eq!(bits(&got.logits), bits(&cold(&model, &p).logits));
    let s = cache.stats();
    assert!(s.ram_hits >= 4 && s.stored >= 2, "{s:?}");
}

#[test]
fn taps_of_a_restored_prefix_are_the_cold_taps() {
    let (model, _) = random_model(13);
    let cache = ram_cache(&model, 1 << 30);
    let p = prompt(5, 140);
    let mut q = p.clone();
    q.extend(prompt(6, 30));
    let mut t = model.taps(&[2, 9]).unwrap();
    Chunked::new(Some(&cache))
        .prefill(&model, &p, Some(&mut t))
        .unwrap()
        .unwrap();
    let mut warm = model.taps(&[2, 9]).unwrap();
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &q, Some(&mut warm))
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 128);
    let mut want = model.taps(&[2, 9]).unwrap();
    let w = OnePass
        .prefill(&model, &q, Some(&mut want))
        .unwrap()
        .unwrap();
    assert_eq!(bits(&got.logits), bits(&w.logits));
    assert_eq!(warm.rows(), q.len());
    assert_eq!(bits(warm.values()), bits(want.values()));
    // Other tap layers cannot use an entry with these: a cold prefill.
    let mut other = model.taps(&[3]).unwrap();
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &q, Some(&mut other))
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 0);
}

#[test]
fn the_disk_tier_survives_a_restart_and_ignores_damage() {
    let (model, _) = random_model(14);
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(7, 200);
    let mut q = p.clone();
    q.extend(prompt(8, 20));
    {
        let (cache, _) = disk_cache(&model, dir.path(), "tag-a");
        let got = Chunked::new(Some(&cache))
            .prefill(&model, &p, None)
            .unwrap()
            .unwrap();
        assert_eq!(got.stored, 1);
    }
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let want = cold(&model, &q);
    // A new cache over the directory (a restarted process) finds the state on disk.
    let (cache, warnings) = disk_cache(&model, dir.path(), "tag-a");
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &q, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 192);
    assert_eq!(bits(&got.logits), bits(&want.logits));
    assert_eq!(cache.stats().disk_hits, 1);
    assert!(warnings.lock().unwrap().is_empty());
    // Another tag (another checkpoint or spine) does not see it, and leaves it.
    let (other, _) = disk_cache(&model, dir.path(), "tag-b");
    let got = Chunked::new(Some(&other))
        .prefill(&model, &q, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 0);
    // Damage: a flipped byte deep in the payload, then a truncation. Each is reported,
    // removed and never used; the answer is the cold one.
    let bytes = std::fs::read(&files[0]).unwrap();
    let damaged = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut b = bytes.clone();
        edit(&mut b);
        std::fs::write(&files[0], &b).unwrap();
        let (cache, warnings) = disk_cache(&model, dir.path(), "tag-a");
        let got = Chunked::new(Some(&cache))
            .prefill(&model, &q, None)
            .unwrap()
            .unwrap();
        assert_eq!(got.reused, 0);
        assert_eq!(bits(&got.logits), bits(&want.logits));
        let w = warnings.lock().unwrap().clone();
        assert!(w.iter().any(|m| m.contains("damaged")), "{w:?}");
        assert_eq!(cache.stats().corrupt, 1);
    };
    damaged(&|b| {
        let i = b.len() / 2;
        b[i] ^= 0x40;
    });
    damaged(&|b| b.truncate(b.len() - 100));
    damaged(&|b| b[3] = b'X');
}

/// The id of a process that ran and is gone (killed, then reaped).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    pid
}

#[test]
fn a_killed_writers_temporaries_are_swept_and_live_ones_count_in_the_budget() {
    let (model, _) = random_model(16);
    let dir = tempfile::tempdir().unwrap();
    // A writer killed between writing a state and renaming it left its temporary; a live
    // writer (a sleeping child standing for another process) has one in progress.
    let orphan = dir
        .path()
        .join(format!(".tmp-00112233aabbccdd-{}-0", dead_pid()));
    std::fs::write(&orphan, vec![7u8; 4096]).unwrap();
    let mut live_writer = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let live = dir
        .path()
        .join(format!(".tmp-00112233aabbccdd-{}-0", live_writer.id()));
    std::fs::write(&live, vec![7u8; 4096]).unwrap();
    let p = prompt(9, 200);
    let (cache, _) = disk_cache(&model, dir.path(), "tag-a");
    assert!(
        !orphan.exists(),
        "the dead writer's temporary is swept at start"
    );
    assert!(live.exists(), "a live writer's temporary is left alone");
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &p, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.stored, 1);
    let state_bytes: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "k3state"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(state_bytes > 0);
    drop(cache);
    // A budget that holds the state but not the state and the live temporary: the
    // temporary counts, so nothing stays past the budget.
    let dir2 = tempfile::tempdir().unwrap();
    let live2 = dir2
        .path()
        .join(format!(".tmp-00112233aabbccdd-{}-1", live_writer.id()));
    std::fs::write(&live2, vec![7u8; 4096]).unwrap();
    let (cache, _) = disk_cache_of(&model, dir2.path(), "tag-a", state_bytes + 100);
    Chunked::new(Some(&cache))
        .prefill(&model, &p, None)
        .unwrap()
        .unwrap();
    let held: u64 = std::fs::read_dir(dir2.path())
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(held <= state_bytes + 100, "{held} bytes held");
    live_writer.kill().unwrap();
    live_writer.wait().unwrap();
}

#[test]
fn the_ram_tier_drops_the_least_recently_used_by_bytes() {
    let (model, _) = random_model(15);
    let a = prompt(21, 100);
    let b = prompt(22, 100);
    let c = prompt(23, 100);
    let one = {
        let probe = ram_cache(&model, 1 << 30);
        Chunked::new(Some(&probe))
            .prefill(&model, &a, None)
            .unwrap()
            .unwrap();
        probe.stats().ram_bytes
    };
    // Room for two snapshots of 64 positions.
    let cache = ram_cache(&model, 2 * one + one / 2);
    for p in [&a, &b] {
        Chunked::new(Some(&cache)).prefill(&model, p, None).unwrap();
    }
    // Touch `a`, then store `c`: `b` goes.
    let hit = |p: &[u32]| {
        Chunked::new(Some(&cache))
            .prefill(&model, p, None)
            .unwrap()
            .unwrap()
            .reused
    };
    assert_eq!(hit(&a), 64);
    Chunked::new(Some(&cache))
        .prefill(&model, &c, None)
        .unwrap();
    assert_eq!(cache.stats().ram_entries, 2);
    assert!(cache.stats().ram_bytes <= 2 * one + one / 2);
    assert_eq!(hit(&a), 64);
    assert_eq!(hit(&c), 64);
    assert_eq!(hit(&b), 0);
}

#[test]
fn an_interrupt_stops_the_prefill_between_layers() {
    let (model, _) = random_model(16);
    let cache = ram_cache(&model, 1 << 30);
    let p = prompt(31, 300);
    let stop = AtomicBool::new(false);
    let seen: Mutex<Vec<PrefillProgress>> = Default::default();
    let mut progress = |pr: PrefillProgress| {
        let mut s = seen.lock().unwrap();
        s.push(pr);
        // Raise the flag in the middle of the second pass.
        if s.len() == model.layers.len() + 3 {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    };
    let mut c = Chunked::new(Some(&cache));
    c.chunk = 64;
    c.interrupt = Some(&stop);
    c.progress = Some(&mut progress);
    assert!(c.prefill(&model, &p, None).unwrap().is_none());
    let s = seen.lock().unwrap().clone();
    // It stopped within one layer of the flag.
    assert_eq!(s.len(), model.layers.len() + 3);
    assert!(s.windows(2).all(|w| w[1].done > w[0].done));
    assert!(s.iter().all(|x| x.total == 300));
    // Nothing half-done was stored; a later run is still exact.
    let got = Chunked::new(Some(&cache))
        .prefill(&model, &p, None)
        .unwrap()
        .unwrap();
    assert_eq!(got.reused, 0);
    assert_eq!(bits(&got.logits), bits(&cold(&model, &p).logits));
}
