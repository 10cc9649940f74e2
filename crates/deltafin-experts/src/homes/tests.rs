use super::place::{check_home, copies_wanted, place_copy, plan, read_copy_sha256, read_source};
use super::*;
use crate::layout::{ExpertLocation, ExpertShape, ExpertTable};
use crate::source::ExpertSource;
use crate::stream::{DirectIo, PilotGate, StreamOptions, StreamingExperts};
use std::collections::HashMap;

const SHAPE: ExpertShape = ExpertShape { f: 64, lr: 64 };
const LAYERS: usize = 3;
const EXPERTS: usize = 6;

/// A model root of `LAYERS` layers (layer 0 dense) × `EXPERTS` experts in one file after a
/// 1000-byte header (so the root's reads are unaligned), and each expert's bytes.
fn fixture(dir: &Path) -> (ExpertTable, HashMap<(usize, usize), Vec<u8>>) {
    let mut data = vec![0u8; 1000];
    let mut want = HashMap::new();
    let mut layers = vec![None];
    let mut x = 99u64;
    for l in 1..LAYERS {
        let mut locs = Vec::new();
        for e in 0..EXPERTS {
            let mut ranges = [(0, 0); 6];
            let start = data.len();
            for (k, &len) in SHAPE.tensor_bytes().iter().enumerate() {
                ranges[k] = (data.len() as u64, len);
                for _ in 0..len {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let b = (x >> 33) as u8;
                    data.push(if k % 2 == 1 { 110 + b % 30 } else { b });
                }
            }
            want.insert((l, e), data[start..].to_vec());
            locs.push(ExpertLocation { file: 0, ranges });
        }
        layers.push(Some(locs));
    }
    let path = dir.join("experts.bin");
    std::fs::write(&path, &data).unwrap();
    (
        ExpertTable {
            files: vec![path],
            shape: SHAPE,
            layers,
        },
        want,
    )
}

fn model() -> HomeModel {
    HomeModel {
        config_sha256: "ab".repeat(32),
        f: SHAPE.f,
        lr: SHAPE.lr,
        num_experts: EXPERTS,
        layers: LAYERS,
    }
}

fn all_experts() -> Vec<(usize, usize)> {
    (1..LAYERS)
        .flat_map(|l| (0..EXPERTS).map(move |e| (l, e)))
        .collect()
}

/// Place every expert of `table` with `replicas` copies over `dirs`; returns the copies made.
fn place_all(table: &ExpertTable, dirs: &[PathBuf], replicas: usize) -> usize {
    let mut homes: Vec<Home> = dirs
        .iter()
        .map(|d| Home::create_or_open(d, &model()).unwrap())
        .collect();
    let wanted = copies_wanted(&all_experts(), replicas, false, homes.len());
    let todo = plan(&homes, &wanted);
    for c in &todo {
        let (bytes, digest) = read_source(table, c.layer, c.expert).unwrap();
        place_copy(&mut homes[c.home], c.layer, c.expert, &bytes, digest).unwrap();
    }
    todo.len()
}

fn opts(table: &ExpertTable, capacity: u64) -> StreamOptions {
    StreamOptions {
        cache_bytes: capacity * table.max_buffer_bytes().max(model().slot_bytes()),
        read_threads: 2,
        direct_io: DirectIo::Auto,
        pilot: PilotGate::Off,
    }
}

fn bytes_of(w: &crate::ExpertWeights) -> Vec<u8> {
    [
        w.w1.packed(),
        w.w1.scales(),
        w.w2.packed(),
        w.w2.scales(),
        w.w3.packed(),
        w.w3.scales(),
    ]
    .concat()
}

fn dirs(n: usize) -> (Vec<tempfile::TempDir>, Vec<PathBuf>) {
    let t: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let p = t.iter().map(|d| d.path().to_path_buf()).collect();
    (t, p)
}

#[test]
fn journal_lines_round_trip_and_a_cut_or_garbled_line_is_skipped() {
    let digest = CopyDigest::of(b"expert bytes");
    let placed = Record::Placed {
        layer: 3,
        expert: 17,
        digest,
    };
    let dropped = Record::Dropped {
        layer: 3,
        expert: 5,
    };
    for r in [placed, dropped] {
        let line = r.line();
        assert!(line.ends_with('\n'));
        assert_eq!(Record::parse(line.trim_end()), Some(r));
    }
    let good = placed.line();
    let cut = &good[..good.len() - 5];
    let garbled = good.replace(" 17 ", " 18 ");
    let text = format!(
        "{good}{cut}\n{garbled}{}",
        Record::Placed {
            layer: 3,
            expert: 5,
            digest
        }
        .line()
            + &dropped.line()
    );
    let j = Journal::parse(text.as_bytes());
    assert_eq!(j.skipped, 2);
    assert_eq!(j.copies.len(), 1, "{j:?}");
    assert_eq!(j.copies.get(&(3, 17)), Some(&digest));
}

#[test]
fn placement_verifies_every_copy_balances_the_homes_and_resumes() {
    let root = tempfile::tempdir().unwrap();
    let (table, want) = fixture(root.path());
    let (_t, dirs) = dirs(3);
    // Interrupted placement: only the first 5 copies are made.
    {
        let mut homes: Vec<Home> = dirs
            .iter()
            .map(|d| Home::create_or_open(d, &model()).unwrap())
            .collect();
        let todo = plan(&homes, &copies_wanted(&all_experts(), 2, false, 3));
        assert_eq!(todo.len(), 2 * all_experts().len());
        for c in todo.iter().take(5) {
            let (bytes, digest) = read_source(&table, c.layer, c.expert).unwrap();
            place_copy(&mut homes[c.home], c.layer, c.expert, &bytes, digest).unwrap();
        }
    }
    // The resumed placement makes only the rest.
    assert_eq!(place_all(&table, &dirs, 2), 2 * all_experts().len() - 5);
    assert_eq!(place_all(&table, &dirs, 2), 0, "nothing left to place");
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    assert_eq!(homes.copies(), 2 * all_experts().len());
    for (l, e) in all_experts() {
        assert_eq!(homes.holders(l, e).count_ones(), 2, "({l}, {e})");
        for h in homes.homes().iter().filter(|h| h.holds(l, e)) {
            let sha: [u8; 32] = Sha256::digest(&want[&(l, e)]).into();
            assert_eq!(read_copy_sha256(h, l, e).unwrap(), sha);
            assert_eq!(h.digest(l, e).unwrap().sha256, sha);
        }
    }
    let bytes: Vec<u64> = homes.homes().iter().map(Home::held_bytes).collect();
    let (lo, hi) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
    assert!(hi - lo <= model().expert_bytes(), "unbalanced: {bytes:?}");
    // Slots are aligned: every layer file is whole slots.
    for h in homes.homes() {
        for l in 1..LAYERS {
            let len = std::fs::metadata(h.layer_path(l)).unwrap().len();
            assert_eq!(len % model().slot_bytes(), 0);
        }
    }
    // More replicas than homes: one copy per home at most.
    assert_eq!(place_all(&table, &dirs, 5), all_experts().len());
    assert_eq!(
        ExpertHomes::open(&dirs, &model()).unwrap().copies(),
        3 * all_experts().len()
    );
}

#[test]
fn the_hottest_tenth_gets_one_more_copy() {
    let order: Vec<(usize, usize)> = (0..20).map(|e| (1, e)).collect();
    let w = copies_wanted(&order, 2, true, 4);
    assert_eq!(w[0].1, 3);
    assert_eq!(w[1].1, 3);
    assert!(w[2..].iter().all(|x| x.1 == 2));
    assert!(copies_wanted(&order, 2, false, 4).iter().all(|x| x.1 == 2));
    assert!(copies_wanted(&order, 2, true, 2).iter().all(|x| x.1 == 2));
}

#[test]
fn a_copy_that_reads_back_different_is_not_journaled() {
    let root = tempfile::tempdir().unwrap();
    let (table, _) = fixture(root.path());
    let (_t, dirs) = dirs(1);
    let mut home = Home::create_or_open(&dirs[0], &model()).unwrap();
    let (bytes, mut digest) = read_source(&table, 1, 2).unwrap();
    digest.sha256[0] ^= 1;
    let err = place_copy(&mut home, 1, 2, &bytes, digest).unwrap_err();
    assert!(err.to_string().contains("read back"), "{err}");
    assert!(!home.holds(1, 2));
    assert!(
        Home::open(&dirs[0], &model())
            .unwrap()
            .journal()
            .copies
            .is_empty()
    );
}

#[test]
fn a_home_of_another_model_or_a_damaged_home_is_refused_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let (table, _) = fixture(root.path());
    let (_t, dirs) = dirs(2);
    place_all(&table, &dirs, 1);
    let other = HomeModel {
        config_sha256: "cd".repeat(32),
        ..model()
    };
    let err = ExpertHomes::open(&dirs, &other).unwrap_err().to_string();
    assert!(err.contains("another model"), "{err}");
    assert!(err.contains(&dirs[0].display().to_string()), "{err}");
    let err = Home::create_or_open(&dirs[0], &other)
        .unwrap_err()
        .to_string();
    assert!(err.contains("another model"), "{err}");
    // A directory that is not there (a drive not mounted).
    let gone = dirs[0].join("not-mounted");
    let err = ExpertHomes::open(std::slice::from_ref(&gone), &model())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&gone.display().to_string()) && err.contains("not mounted"),
        "{err}"
    );
    // A directory without a home.
    let empty = tempfile::tempdir().unwrap();
    let err = ExpertHomes::open(&[empty.path().to_path_buf()], &model())
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds no experts"), "{err}");
    // The same home twice.
    let err = ExpertHomes::open(&[dirs[0].clone(), dirs[0].clone()], &model())
        .unwrap_err()
        .to_string();
    assert!(err.contains("named twice"), "{err}");
    // A damaged home.json, and a cut layer file.
    let h1 = Home::open(&dirs[1], &model()).unwrap();
    let layer_file = h1.layer_path(2);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&layer_file)
        .unwrap()
        .set_len(10)
        .unwrap();
    let err = ExpertHomes::open(&dirs, &model()).unwrap_err().to_string();
    assert!(
        err.contains(&layer_file.display().to_string()) && err.contains("cut"),
        "{err}"
    );
    std::fs::write(dirs[0].join(HOME_SUBDIR).join(HOME_FILE), "{").unwrap();
    let err = Home::open(&dirs[0], &model()).unwrap_err().to_string();
    assert!(err.contains("damaged"), "{err}");
}

#[test]
fn homes_of_other_weights_under_the_same_config_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let (table, _) = fixture(root.path());
    let (_t, dirs) = dirs(1);
    place_all(&table, &dirs, 1);
    // The same geometry and config digest, other bytes.
    let other = tempfile::tempdir().unwrap();
    let (mut table2, _) = fixture(other.path());
    let p = &table2.files[0];
    let mut b = std::fs::read(p).unwrap();
    for x in b.iter_mut().skip(1000).step_by(97) {
        *x ^= 0x21;
    }
    std::fs::write(p, b).unwrap();
    table2.files[0] = p.clone();
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    let err = StreamingExperts::with_homes(table2.clone(), opts(&table2, 2), Some(homes))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another model") && err.contains(&dirs[0].display().to_string()),
        "{err}"
    );
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    assert!(StreamingExperts::with_homes(table.clone(), opts(&table, 2), Some(homes)).is_ok());
}

#[test]
fn streaming_from_homes_gives_the_root_bytes_and_spreads_the_reads() {
    let root = tempfile::tempdir().unwrap();
    let (table, want) = fixture(root.path());
    let (_t, dirs) = dirs(2);
    place_all(&table, &dirs, 1);
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    let src = StreamingExperts::with_homes(table.clone(), opts(&table, 3), Some(homes)).unwrap();
    for round in 0..2 {
        for l in 1..LAYERS {
            let union: Vec<usize> = (0..EXPERTS).filter(|e| (e + round) % 4 != 0).collect();
            src.begin_layer(l, &union);
            for &e in &union {
                assert_eq!(bytes_of(&src.expert(l, e).unwrap()), want[&(l, e)]);
            }
        }
    }
    let st = src.stats().unwrap();
    assert_eq!(st.homes.len(), 2);
    assert!(
        st.homes.iter().all(|h| h.bytes > 0 && h.failures == 0),
        "{st:?}"
    );
    assert_eq!(st.home_fallbacks, 0);
    // Every read went to a home: their bytes are all the bytes transferred.
    assert_eq!(
        st.homes.iter().map(|h| h.bytes).sum::<u64>(),
        st.device_bytes
    );
    assert!(
        st.summary_line().contains(" homes="),
        "{}",
        st.summary_line()
    );
}

#[test]
fn experts_no_home_holds_come_from_the_model_root() {
    let root = tempfile::tempdir().unwrap();
    let (table, want) = fixture(root.path());
    let (_t, dirs) = dirs(1);
    let mut home = Home::create_or_open(&dirs[0], &model()).unwrap();
    let (bytes, digest) = read_source(&table, 1, 0).unwrap();
    place_copy(&mut home, 1, 0, &bytes, digest).unwrap();
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    let src = StreamingExperts::with_homes(table.clone(), opts(&table, 2), Some(homes)).unwrap();
    for (l, e) in all_experts() {
        assert_eq!(bytes_of(&src.expert(l, e).unwrap()), want[&(l, e)]);
    }
    let st = src.stats().unwrap();
    assert_eq!(st.homes[0].bytes, model().slot_bytes(), "{st:?}");
    assert!(st.device_bytes > st.homes[0].bytes);
}

#[test]
fn a_damaged_or_lost_copy_falls_back_never_a_wrong_expert() {
    let root = tempfile::tempdir().unwrap();
    let (table, want) = fixture(root.path());
    let (_t, dirs) = dirs(2);
    place_all(&table, &dirs, 1);
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    // Damage home 0's copies after they were verified: one flipped byte in every slot of
    // layer 1 (valid-looking MXFP4 codes, so only the checksum can tell), and layer 2's
    // file cut to nothing (reads come up short, as from a failing drive).
    let h0 = &homes.homes()[0];
    let f1 = h0.layer_path(1);
    let mut b = std::fs::read(&f1).unwrap();
    for e in (0..EXPERTS).filter(|&e| h0.holds(1, e)) {
        b[h0.slot_offset(e) as usize + 7] ^= 0x10;
    }
    std::fs::write(&f1, &b).unwrap();
    let held0 = h0.journal().copies.len();
    let src = StreamingExperts::with_homes(table.clone(), opts(&table, 2), Some(homes)).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(dirs[0].join(HOME_SUBDIR).join(layer_file_name(2)))
        .unwrap()
        .set_len(0)
        .unwrap();
    for _ in 0..2 {
        for (l, e) in all_experts() {
            assert_eq!(
                bytes_of(&src.expert(l, e).unwrap()),
                want[&(l, e)],
                "({l}, {e})"
            );
        }
    }
    let st = src.stats().unwrap();
    assert_eq!(st.homes[0].failures as usize, held0, "{st:?}");
    assert_eq!(st.home_fallbacks as usize, held0);
    assert_eq!(st.homes[1].failures, 0);
    // `check_home` finds the same copies and takes them out of the journal.
    let mut h = Home::open(&dirs[0], &model());
    if let Err(e) = &h {
        // Layer 2's file is cut, so opening names it; drop its copies by hand to go on.
        assert!(e.to_string().contains("cut"), "{e}");
        let mut j = std::fs::OpenOptions::new()
            .append(true)
            .open(dirs[0].join(HOME_SUBDIR).join(JOURNAL_FILE))
            .unwrap();
        for e in 0..EXPERTS {
            j.write_all(
                Record::Dropped {
                    layer: 2,
                    expert: e,
                }
                .line()
                .as_bytes(),
            )
            .unwrap();
        }
        h = Home::open(&dirs[0], &model());
    }
    let mut h = h.unwrap();
    let c = check_home(&mut h).unwrap();
    assert!(c.checked > 0 && c.dropped.len() == c.checked, "{c:?}");
    assert!(
        Home::open(&dirs[0], &model())
            .unwrap()
            .journal()
            .copies
            .is_empty()
    );
}

#[test]
fn a_failed_copy_is_read_from_the_other_home_before_the_model_root() {
    let root = tempfile::tempdir().unwrap();
    let (table, want) = fixture(root.path());
    let (_t, dirs) = dirs(2);
    place_all(&table, &dirs, 2);
    let homes = ExpertHomes::open(&dirs, &model()).unwrap();
    let f = homes.homes()[0].layer_path(1);
    let mut b = std::fs::read(&f).unwrap();
    for e in 0..EXPERTS {
        b[homes.homes()[0].slot_offset(e) as usize + 100] ^= 1;
    }
    std::fs::write(&f, &b).unwrap();
    let src = StreamingExperts::with_homes(table.clone(), opts(&table, 2), Some(homes)).unwrap();
    for _ in 0..3 {
        for (l, e) in all_experts() {
            assert_eq!(
                bytes_of(&src.expert(l, e).unwrap()),
                want[&(l, e)],
                "({l}, {e})"
            );
        }
    }
    let st = src.stats().unwrap();
    // Each damaged copy failed once (then never read again) and moved to home 1.
    assert!(st.homes[0].failures as usize <= EXPERTS, "{st:?}");
    assert_eq!(st.homes[0].failures, st.home_fallbacks);
    assert!(st.home_fallbacks > 0, "{st:?}");
    // Nothing came from the model root: every byte transferred was a home's.
    assert_eq!(
        st.homes.iter().map(|h| h.bytes).sum::<u64>(),
        st.device_bytes,
        "{st:?}"
    );
}
