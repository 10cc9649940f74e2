//! Tests of [`super::copy_to_anonymous`]: layout, O_DIRECT and buffered reads, errors.

use super::*;
use crate::storage::map_file;
use std::io::Write;

#[test]
fn anonymous_copies_keep_bytes_order_and_alignment() {
    let parts = [
        Bytes::from_vec((0..100u8).collect()),
        Bytes::from_vec(Vec::new()),
        Bytes::from_vec((0..4097u32).map(|i| (i * 7 % 251) as u8).collect()),
        Bytes::from_vec(vec![9u8; 3]).slice(1..3).unwrap(),
    ];
    for huge in [false, true] {
        let c = copy_to_anonymous(&parts, huge, &|_, _| {}).unwrap();
        assert_eq!(c.views.len(), parts.len());
        for (v, p) in c.views.iter().zip(&parts) {
            assert_eq!(v.as_slice(), p.as_slice());
            assert!((v.as_slice().as_ptr() as usize).is_multiple_of(ANON_ALIGN));
        }
        // 100 → 128, 0, 4097 → 4160, 2 → 64.
        assert_eq!(c.mapped, 128 + 4160 + 64);
        assert_eq!(c.stats.memory_bytes, 100 + 4097 + 2);
        assert_eq!(c.stats.read_bytes(), 0);
        if !huge {
            assert!(!c.huge_advised);
        }
    }
    let none = copy_to_anonymous(&[], true, &|_, _| {}).unwrap();
    assert!(none.views.is_empty());
    assert_eq!(none.mapped, 0);
}

/// `data` written to `dir/name`, synced and dropped from the page cache where the system
/// allows it (so that the copy reads it with O_DIRECT), then mapped.
fn file_with(dir: &std::path::Path, name: &str, data: &[u8]) -> Bytes {
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let f = std::fs::File::open(&path).unwrap();
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor; POSIX_FADV_DONTNEED only affects caching.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    map_file(&f, &path).unwrap()
}

fn pattern(n: usize, salt: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 13) as u8)
        .collect()
}

/// Views of two files (runs of adjacent views, a gap, views out of file order) and of
/// memory, read with O_DIRECT where the filesystem takes it and buffered: the bytes are
/// the sources', each file view keeps its offset modulo 4 KiB, runs of adjacent views stay
/// adjacent, and progress covers every part byte once.
#[test]
fn file_views_are_read_into_place_with_their_page_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let a_data = pattern(READ_CHUNK + 3 * 4096 + 123, 1);
    let b_data = pattern(50_000, 2);
    let a = file_with(dir.path(), "a.bin", &a_data);
    let b = file_with(dir.path(), "b.bin", &b_data);
    let r = |v: &Bytes, s: usize, e: usize| v.slice(s..e).unwrap();
    let parts = vec![
        r(&a, 8, 1000),                         // run 1 ...
        r(&a, 1000, READ_CHUNK + 5000),         // ... continued across a read chunk
        Bytes::from_vec(pattern(777, 3)),       // memory
        r(&b, 4096, 8192),                      // an aligned view
        r(&a, 20_000, 20_100),                  // inside run 1's range, out of order
        r(&b, 10, 11),                          // one byte
        r(&a, READ_CHUNK + 5000, a_data.len()), // continues nothing (not after b)
        Bytes::from_vec(Vec::new()),
    ];
    for allow_direct in [true, false] {
        let done = AtomicU64::new(0);
        let c = copy_with(&parts, true, allow_direct, &|n, total| {
            done.fetch_add(n, Ordering::Relaxed);
            assert_eq!(total, parts.iter().map(|p| p.len() as u64).sum::<u64>());
        })
        .unwrap();
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        assert_eq!(done.into_inner(), total);
        assert_eq!(c.stats.total_bytes(), total);
        assert_eq!(c.stats.memory_bytes, 777);
        if !allow_direct {
            assert_eq!(c.stats.direct_bytes, 0);
        } else if cfg!(target_os = "linux") {
            // Where the filesystem takes O_DIRECT, the cold file views came that way.
            assert!(
                c.stats.direct_bytes > 0 || c.stats.direct_refused.is_some(),
                "{:?}",
                c.stats
            );
        }
        let (largest, bytes) = c.stats.largest_file.clone().unwrap();
        assert_eq!(largest, dir.path().join("a.bin"));
        assert_eq!(bytes, (a_data.len() - 8 + 100) as u64);
        let base = c.views[0].as_slice().as_ptr() as usize;
        for (k, (v, p)) in c.views.iter().zip(&parts).enumerate() {
            assert_eq!(v.as_slice(), p.as_slice(), "part {k}");
            let addr = v.as_slice().as_ptr() as usize;
            if let Some((_, off)) = p.file_origin() {
                assert_eq!(addr % 4096, off as usize % 4096, "part {k}");
            } else if !p.is_empty() {
                assert_eq!(addr % ANON_ALIGN, 0, "part {k}");
            }
        }
        let at = |k: usize| c.views[k].as_slice().as_ptr() as usize - base;
        assert_eq!(at(1), at(0) + parts[0].len(), "a run stays back to back");
        assert!(c.mapped < total as usize + 6 * 8192);
    }
}

#[test]
fn a_file_truncated_after_mapping_is_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(3 * 4096, 4);
    let v = file_with(dir.path(), "t.bin", &data);
    let path = dir.path().join("t.bin");
    let part = v.slice(4096..3 * 4096).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5000)
        .unwrap();
    for allow_direct in [true, false] {
        let e =
            copy_with(std::slice::from_ref(&part), false, allow_direct, &|_, _| {}).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("t.bin") && msg.contains("file ends"), "{msg}");
    }
}

#[test]
fn a_file_replaced_since_mapping_is_copied_from_the_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(2 * 4096, 5);
    let v = file_with(dir.path(), "r.bin", &data);
    let path = dir.path().join("r.bin");
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, vec![0u8; data.len()]).unwrap();
    let c = copy_to_anonymous(std::slice::from_ref(&v), false, &|_, _| {}).unwrap();
    assert_eq!(c.views[0].as_slice(), &data[..]);
    assert_eq!(c.stats.memory_bytes, data.len() as u64);
}

#[test]
fn the_layout_gives_each_file_run_whole_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let f = file_with(dir.path(), "l.bin", &pattern(20_000, 6));
    let parts = vec![
        Bytes::from_vec(vec![1; 10]),
        f.slice(100..200).unwrap(),
        f.slice(200..5000).unwrap(),
        Bytes::from_vec(vec![2; 70]),
        f.slice(9000..9001).unwrap(),
    ];
    let l = layout(&parts).unwrap();
    assert_eq!(
        l.offsets,
        vec![0, 4096 + 100, 4096 + 200, 12288, 16384 + 9000 % 4096]
    );
    assert_eq!(l.runs.len(), 4);
    assert_eq!(l.runs[1].len, 4900);
    assert_eq!(l.runs[1].footprint(), 4096..12288);
    assert_eq!(l.total, 16384 + 4096);
    for w in l.runs.windows(2) {
        assert!(w[0].footprint().end <= w[1].footprint().start);
    }
}
