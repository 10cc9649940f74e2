use super::pieces::split_regions;
use super::*;
use crate::layout::ExpertLocation;
use crate::layout::{ExpertShape, ReadPlan, Region};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

type Parts = HashMap<(usize, usize), Vec<Vec<u8>>>;

const SHAPE: ExpertShape = ExpertShape { f: 64, lr: 64 };

/// One file holding `layers` (layer 0 dense) × `experts` experts after a 1000-byte header;
/// returns the table and each expert's six tensors.
fn fixture(dir: &std::path::Path, layers: usize, experts: usize) -> (ExpertTable, Parts) {
    let mut data = vec![0u8; 1000];
    let mut want = HashMap::new();
    let mut table_layers = vec![None];
    let mut x = 12345u64;
    for l in 1..layers {
        let mut locs = Vec::new();
        for e in 0..experts {
            let mut ranges = [(0, 0); 6];
            let mut parts = Vec::new();
            for (k, &len) in SHAPE.tensor_bytes().iter().enumerate() {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let b = (x >> 33) as u8;
                        if k % 2 == 1 { 110 + b % 30 } else { b }
                    })
                    .collect();
                ranges[k] = (data.len() as u64, len);
                data.extend_from_slice(&bytes);
                parts.push(bytes);
            }
            want.insert((l, e), parts);
            locs.push(ExpertLocation { file: 0, ranges });
        }
        table_layers.push(Some(locs));
    }
    let path = dir.join("experts.bin");
    std::fs::write(&path, &data).unwrap();
    (
        ExpertTable {
            files: vec![path],
            shape: SHAPE,
            layers: table_layers,
        },
        want,
    )
}

fn check(w: &ExpertWeights, parts: &[Vec<u8>]) {
    assert_eq!(w.w1.packed(), &parts[0][..]);
    assert_eq!(w.w1.scales(), &parts[1][..]);
    assert_eq!(w.w2.packed(), &parts[2][..]);
    assert_eq!(w.w2.scales(), &parts[3][..]);
    assert_eq!(w.w3.packed(), &parts[4][..]);
    assert_eq!(w.w3.scales(), &parts[5][..]);
}

/// One row's guesses, most confident first.
fn guesses(ids: &[usize]) -> Vec<PilotGuess> {
    crate::rank_guesses([ids])
}

fn opts(capacity: u64, table: &ExpertTable, pilot: PilotGate) -> StreamOptions {
    StreamOptions {
        cache_bytes: capacity * table.max_buffer_bytes(),
        read_threads: 2,
        direct_io: DirectIo::Auto,
        pilot,
    }
}

#[test]
fn streamed_bytes_match_the_file_and_the_budget_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 8);
    let o = opts(3, &table, PilotGate::Off);
    let budget = o.cache_bytes;
    let src = StreamingExperts::new(table, o).unwrap();
    for round in 0..4 {
        for l in 1..3 {
            let union: Vec<usize> = (0..8).filter(|e| (e + round + l) % 3 != 0).collect();
            src.begin_layer(l, &union);
            for &e in &union {
                check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
                assert!(src.cache_bytes_now() <= budget);
            }
        }
    }
    let st = src.stats().unwrap();
    assert!(st.cache_peak_bytes <= budget, "{st:?}");
    assert!(st.total().misses > 0 && st.reads > 0);
    // Unhinted requests work too.
    check(&src.expert(2, 7).unwrap(), &want[&(2, 7)]);
}

#[test]
fn regions_split_into_aligned_pieces_that_cover_them() {
    let plan = ReadPlan {
        regions: vec![
            Region {
                file_offset: 8192,
                len: 5 * ALIGN,
                buf_offset: 0,
                need_to: 4 * ALIGN + 100,
            },
            Region {
                file_offset: 65536,
                len: ALIGN,
                buf_offset: 5 * ALIGN,
                need_to: ALIGN,
            },
        ],
        tensor_at: [0; 6],
        buf_len: 6 * ALIGN,
    };
    let pieces = split_regions(&plan, 2 * ALIGN);
    let got: Vec<(u64, u64, u64, u64)> = pieces
        .iter()
        .map(|r| (r.file_offset, r.len, r.buf_offset, r.need_to))
        .collect();
    assert_eq!(
        got,
        vec![
            (8192, 2 * ALIGN, 0, 2 * ALIGN),
            (8192 + 2 * ALIGN, 2 * ALIGN, 2 * ALIGN, 2 * ALIGN),
            (8192 + 4 * ALIGN, ALIGN, 4 * ALIGN, 100),
            (65536, ALIGN, 5 * ALIGN, ALIGN),
        ]
    );
    assert_eq!(split_regions(&plan, 0).len(), 2);
    // Equal pieces: 5 blocks in pieces of ≤ 4 blocks are 3 + 2, not 4 + 1.
    let lens: Vec<u64> = split_regions(&plan, 4 * ALIGN)
        .iter()
        .map(|r| r.len / ALIGN)
        .collect();
    assert_eq!(lens, vec![3, 2, 1]);
}

#[test]
fn piecewise_reads_give_the_same_bytes_and_count_every_piece() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 8);
    let o = StreamOptions {
        read_threads: 4,
        ..opts(4, &table, PilotGate::Measure)
    };
    let src = StreamingExperts::new(table.clone(), o).unwrap();
    let e = src.set_read_piece_bytes(1000).unwrap_err().to_string();
    assert!(e.contains("multiple of 4096"), "{e}");
    src.set_read_piece_bytes(ALIGN).unwrap();
    // One piece per aligned block of every expert (each is read once: a cold pass).
    let mut pieces = 0;
    for l in 1..3 {
        let union: Vec<usize> = (0..8).collect();
        src.begin_layer(l, &union);
        for &e in &union {
            pieces += ReadPlan::new(table.get(l, e).unwrap()).buf_len / ALIGN;
            check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
        }
    }
    let st = src.stats().unwrap();
    assert_eq!(st.total().bytes_read, 16 * SHAPE.expert_bytes());
    assert!(pieces > 16 * 2, "{pieces}");
    assert_eq!(st.reads, pieces, "{st:?}");
}

#[test]
fn wrong_guesses_cancelled_mid_read_keep_bytes_and_budget_right() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 4, 12);
    let o = StreamOptions {
        read_threads: 3,
        ..opts(6, &table, PilotGate::Off)
    };
    let budget = o.cache_bytes;
    let src = StreamingExperts::new(table.clone(), o).unwrap();
    src.set_read_piece_bytes(ALIGN).unwrap();
    for round in 0..40usize {
        for l in 1..4 {
            let union: Vec<usize> = (0..12).filter(|e| (e + round * l) % 4 == 0).collect();
            src.begin_layer(l, &union);
            if l < 3 {
                // Half right, half wrong guesses for the next layer.
                let guess: Vec<usize> = (0..12).filter(|e| (e + round) % 3 != 1).take(5).collect();
                src.predict(l + 1, 1, &guesses(&guess));
            }
            let mut pending = union.clone();
            while !pending.is_empty() {
                let e = pending.remove(src.next_ready(l, &pending));
                check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
                assert!(src.cache_bytes_now() <= budget);
            }
        }
    }
    let st = src.stats().unwrap();
    assert!(st.cache_peak_bytes <= budget, "{st:?}");
    assert!(st.total().prefetch_bytes > 0, "{st:?}");
}

#[test]
fn next_ready_names_a_resident_expert_before_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 2, 8);
    // Two buffers: a window of one, taken by the hit, so expert 0 is not read yet.
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Measure)).unwrap();
    src.begin_layer(1, &[3]);
    src.expert(1, 3).unwrap();
    src.begin_layer(1, &[0, 3]);
    assert_eq!(src.next_ready(1, &[0, 3]), 1);
    check(&src.expert(1, 3).unwrap(), &want[&(1, 3)]);
    // Consuming the hit started expert 0's read; next_ready waits for it.
    assert_eq!(src.next_ready(1, &[0]), 0);
    check(&src.expert(1, 0).unwrap(), &want[&(1, 0)]);
    let t = src.stats().unwrap().total();
    assert_eq!((t.hits, t.misses), (1, 2));
}

#[test]
fn a_cold_pass_reads_each_union_expert_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let (table, _) = fixture(dir.path(), 4, 16);
    let eb = SHAPE.expert_bytes();
    // The cache holds 4 experts, each layer's union is 10: the window reads ahead in order.
    let src = StreamingExperts::new(table.clone(), opts(4, &table, PilotGate::Measure)).unwrap();
    let mut pairs = 0u64;
    for l in 1..4 {
        let union: Vec<usize> = (0..16).filter(|e| (e * 7 + l) % 16 < 10).collect();
        pairs += union.len() as u64;
        src.begin_layer(l, &union);
        for &e in &union {
            src.expert(l, e).unwrap();
        }
    }
    let t = src.stats().unwrap().total();
    assert_eq!(t.bytes_read, pairs * eb);
    assert_eq!((t.misses, t.hits), (pairs, 0));
}

#[test]
fn pilot_prefetch_counts_recall_and_hits() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 8);
    let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
    src.begin_layer(1, &[0, 1]);
    src.predict(2, 1, &guesses(&[2, 3, 4, 5]));
    src.expert(1, 0).unwrap();
    src.expert(1, 1).unwrap();
    src.begin_layer(2, &[3, 4, 6]);
    for e in [3, 4, 6] {
        check(&src.expert(2, e).unwrap(), &want[&(2, e)]);
    }
    let l2 = &src.stats().unwrap().layers[2];
    assert_eq!((l2.predicted_hits, l2.predicted_total), (2, 3));
    assert_eq!((l2.hits, l2.prefetch_hits, l2.misses), (2, 2, 1));

    // `measure` predicts but reads nothing speculatively.
    let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Measure)).unwrap();
    src.predict(2, 1, &guesses(&[2, 3]));
    src.begin_layer(2, &[3]);
    src.expert(2, 3).unwrap();
    let l2 = &src.stats().unwrap().layers[2];
    assert_eq!((l2.prefetch_bytes, l2.hits, l2.predicted_hits), (0, 0, 1));
}

/// Bytes a fresh source transfers for a PILOT guess of expert `e` of `layer` alone.
fn guess_read_alone(table: &ExpertTable, layer: usize, e: usize) -> u64 {
    let src = StreamingExperts::new(table.clone(), opts(2, table, PilotGate::Off)).unwrap();
    src.predict(layer, 1, &guesses(&[e]));
    src.settle();
    src.stats().unwrap().device_bytes
}

/// A source with one I/O thread and pieces of [`ALIGN`] bytes (reads stay in flight long
/// enough for a test to act between them), 8 buffers, PILOT reads on.
fn one_thread_small_pieces(table: &ExpertTable) -> StreamingExperts {
    let src = StreamingExperts::new(
        table.clone(),
        StreamOptions {
            read_threads: 1,
            ..opts(8, table, PilotGate::Off)
        },
    )
    .unwrap();
    src.set_read_piece_bytes(ALIGN).unwrap();
    src
}

#[test]
fn guesses_rank_by_best_position_then_votes_then_id() {
    let g = crate::rank_guesses([&[5usize, 2, 7][..], &[2, 9, 5], &[3, 9, 1]]);
    let got: Vec<(usize, usize, usize)> = g.iter().map(|g| (g.expert, g.rank, g.votes)).collect();
    assert_eq!(
        got,
        vec![
            (2, 0, 2),
            (5, 0, 2),
            (3, 0, 1),
            (9, 1, 2),
            (1, 2, 1),
            (7, 2, 1)
        ]
    );
    assert_eq!(
        guesses(&[4, 1])
            .iter()
            .map(|g| (g.expert, g.rank))
            .collect::<Vec<_>>(),
        vec![(4, 0), (1, 1)]
    );
}

#[test]
fn pilot_reads_the_most_confident_guesses_first_and_accounts_waste() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 8);
    // Two buffers: only the two most confident guesses (5, then 2) can be read; id order
    // would have read 2 and 5, router order 7 last.
    let alone = |l: usize, e: usize| guess_read_alone(&table, l, e);
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
    src.predict(2, 1, &guesses(&[5, 2, 7]));
    src.settle();
    assert_eq!(src.stats().unwrap().device_bytes, alone(2, 5) + alone(2, 2));
    src.begin_layer(2, &[5, 7]);
    let st = src.stats().unwrap();
    let l2 = &st.layers[2];
    assert_eq!((l2.hits, l2.prefetch_hits, l2.misses), (1, 1, 1));
    assert_eq!((l2.prefetch_issued, l2.prefetch_right), (2, 1));
    assert_eq!(
        l2.prefetch_wasted_bytes,
        alone(2, 2),
        "the wrong guess 2 was read whole"
    );
    assert_eq!(l2.prefetch_precision(), Some(0.5));
    assert_eq!(l2.prefetch_recall(), Some(0.5));
    let ranks: Vec<(u64, u64, u64, u64)> = st
        .pilot_ranks
        .iter()
        .map(|r| (r.guesses, r.right, r.prefetched, r.prefetched_right))
        .collect();
    assert_eq!(ranks, vec![(1, 1, 1, 1), (1, 0, 1, 0), (1, 1, 0, 0)]);
    assert!(st.pilot_ranks_batch.is_empty());
    for e in [5, 7] {
        check(&src.expert(2, e).unwrap(), &want[&(2, e)]);
    }
    let line = st.summary_line();
    assert!(line.contains("prefetch_precision=50.0%"), "{line}");
    assert!(
        st.per_rank_precision().starts_with("0:100.0(100.0)"),
        "{st:?}"
    );

    // Wrong guesses cut at the layer's start (dropped unread, cancelled mid-read, or
    // landed whole, depending on timing) waste exactly the bytes they transferred.
    let src = one_thread_small_pieces(&table);
    src.predict(1, 1, &guesses(&[0, 1, 2, 3, 4, 5]));
    src.begin_layer(1, &[0]);
    src.settle();
    let st = src.stats().unwrap();
    let l1 = &st.layers[1];
    assert_eq!(l1.prefetch_issued, 6);
    // Whatever was transferred for the five wrong guesses is wasted, nothing more.
    assert_eq!(l1.prefetch_wasted_bytes, st.device_bytes - alone(1, 0));
    let all: u64 = (0..6).map(|e| alone(1, e)).sum();
    assert!(st.device_bytes <= all);
}

#[test]
fn a_newer_guess_for_the_same_layer_keeps_what_it_repeats_and_discards_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 8);
    let alone = |e: usize| guess_read_alone(&table, 1, e);
    // The same guess twice (a provisional next token that turned out right): nothing is
    // read twice, and the reads count as the guess's, right and prefetched.
    let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
    src.predict(1, 1, &guesses(&[2, 5]));
    src.settle();
    src.predict(1, 1, &guesses(&[2, 5]));
    src.settle();
    let once = alone(2) + alone(5);
    assert_eq!(src.stats().unwrap().device_bytes, once);
    src.begin_layer(1, &[2, 5]);
    let l1 = src.stats().unwrap().layers[1].clone();
    assert_eq!((l1.hits, l1.prefetch_hits, l1.misses), (2, 2, 0));
    assert_eq!((l1.prefetch_issued, l1.prefetch_right), (2, 2));
    assert_eq!(l1.prefetch_wasted_bytes, 0);
    assert_eq!((l1.predictions, l1.predicted_hits), (1, 2));

    // A different second guess: the first's reads it does not repeat lose their unstarted
    // pieces at once (issued, what they transferred wasted); the repeated one is judged
    // with the second guess.
    let src = one_thread_small_pieces(&table);
    src.predict(1, 1, &guesses(&[0, 1, 2, 3]));
    src.predict(1, 1, &guesses(&[3, 6]));
    src.begin_layer(1, &[3, 6]);
    src.settle();
    let st = src.stats().unwrap();
    let l1 = &st.layers[1];
    assert_eq!(l1.prefetch_issued, 5, "{l1:?}");
    assert_eq!(l1.prefetch_right, 2, "{l1:?}");
    assert_eq!(
        l1.prefetch_wasted_bytes,
        st.device_bytes - alone(3) - alone(6)
    );
    assert_eq!((l1.predictions, l1.predicted_hits), (1, 2));
    for e in [3, 6] {
        check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
    }

    // A superseded read that had landed stays cached and is judged when the layer
    // begins: here it is needed after all, so it is a right prefetch, not waste.
    let src = StreamingExperts::new(table.clone(), opts(8, &table, PilotGate::Off)).unwrap();
    src.predict(1, 1, &guesses(&[4]));
    src.settle();
    src.predict(1, 1, &guesses(&[5]));
    src.settle();
    src.begin_layer(1, &[4, 5]);
    let l1 = src.stats().unwrap().layers[1].clone();
    assert_eq!((l1.hits, l1.prefetch_hits, l1.misses), (2, 2, 0));
    assert_eq!((l1.prefetch_issued, l1.prefetch_right), (2, 2));
    assert_eq!(l1.prefetch_wasted_bytes, 0);
    for e in [4, 5] {
        check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
    }
}

#[test]
fn ranked_gate_turns_a_rank_off_and_back_on_by_measured_precision() {
    let dir = tempfile::tempdir().unwrap();
    let (table, _) = fixture(dir.path(), 3, 64);
    let gate = PilotGate::Ranked {
        precision: 0.5,
        warmup: 4,
        max_guesses: 0,
    };
    let src = StreamingExperts::new(table.clone(), opts(4, &table, gate)).unwrap();
    // Each round guesses two fresh experts; rank 0 is always right, rank 1 is right only
    // from round 30 on.
    let round = |r: usize| {
        let (a, b) = ((2 * r) % 64, (2 * r + 1) % 64);
        src.predict(2, 1, &guesses(&[a, b]));
        src.settle();
        let union: Vec<usize> = if r >= 30 { vec![a, b] } else { vec![a] };
        src.begin_layer(2, &union);
        for &e in &union {
            src.expert(2, e).unwrap();
        }
        src.stats().unwrap().pilot_ranks
    };
    for r in 0..30 {
        let ranks = round(r);
        // Judged before the gate: warm-up prefetches, then rank 1 is switched off.
        assert_eq!(ranks[1].gated, r >= 3, "round {r}: {ranks:?}");
        assert!(!ranks[0].gated);
    }
    let ranks = round(30);
    assert_eq!(ranks[0].prefetched, 31);
    assert_eq!(
        ranks[1].prefetched, 4,
        "rank 1 read only during its warm-up"
    );
    let mut back_on = None;
    for r in 31..90 {
        let ranks = round(r);
        if !ranks[1].gated {
            back_on = Some(r);
            break;
        }
    }
    // ≈ 30 wrong then right guesses: precision passes 1/2 after ≈ 30 right ones.
    let r = back_on.expect("rank 1 is measured while gated and comes back");
    assert!((55..65).contains(&r), "back on at round {r}");
    let before = round(r + 1)[1].prefetched;
    assert_eq!(round(r + 2)[1].prefetched, before + 1);
    // Batch passes keep their own table.
    src.predict(1, 4, &crate::rank_guesses([&[0usize, 1][..], &[1, 2]]));
    src.begin_layer(1, &[1]);
    let st = src.stats().unwrap();
    assert_eq!(st.pilot_ranks_batch.len(), 2);
    assert_eq!(st.pilot_ranks_batch[0].guesses, 2);
}

#[test]
fn ranked_gate_caps_the_reads_of_one_prediction() {
    let dir = tempfile::tempdir().unwrap();
    let (table, _) = fixture(dir.path(), 3, 8);
    let gate = PilotGate::Ranked {
        precision: 0.0,
        warmup: 1,
        max_guesses: 2,
    };
    let src = StreamingExperts::new(table.clone(), opts(8, &table, gate)).unwrap();
    src.predict(2, 1, &guesses(&[6, 1, 4, 3]));
    src.settle();
    src.begin_layer(2, &[1, 3, 6]);
    let st = src.stats().unwrap();
    let prefetched: Vec<u64> = st.pilot_ranks.iter().map(|r| r.prefetched).collect();
    assert_eq!(prefetched, vec![1, 1, 0, 0]);
    assert_eq!((st.layers[2].prefetch_issued, st.layers[2].hits), (2, 2));
    let bad = StreamingExperts::new(
        table.clone(),
        opts(
            8,
            &table,
            PilotGate::Ranked {
                precision: 1.5,
                warmup: 1,
                max_guesses: 0,
            },
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(bad.contains("ranked PILOT precision"), "{bad}");
}

#[test]
fn pinned_tier_fills_on_authoritative_reads_and_is_never_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 3, 16);
    // 6 buffers, 3 of them pinned: candidates (1,5), (2,9), (1,2); (2,0) is beyond the
    // tier's size and (7,0) outside the table.
    let src = StreamingExperts::new(table.clone(), opts(6, &table, PilotGate::Off)).unwrap();
    let eb = src.buffer_bytes();
    let e = src.set_pin_tier(&[(1, 5)], 6 * eb).unwrap_err().to_string();
    assert!(e.contains("leaves no buffer"), "{e}");
    let slots = src
        .set_pin_tier(&[(7, 0), (1, 5), (2, 9), (1, 2), (2, 0)], 3 * eb)
        .unwrap();
    assert_eq!(slots, 3);
    // A PILOT guess of a candidate does not pin it.
    src.predict(2, 1, &guesses(&[9]));
    src.begin_layer(1, &[0, 1]);
    for e in [0, 1] {
        src.expert(1, e).unwrap();
    }
    assert_eq!(src.stats().unwrap().pinned_experts, 0);
    // Authoritative reads pin the candidates.
    src.begin_layer(1, &[2, 5]);
    src.expert(1, 2).unwrap();
    src.expert(1, 5).unwrap();
    src.begin_layer(2, &[0, 9]);
    src.expert(2, 0).unwrap();
    src.expert(2, 9).unwrap();
    assert_eq!(src.stats().unwrap().pinned_experts, 3);
    // Churn through every other expert many times: the pinned ones stay resident.
    for round in 0..5 {
        for l in 1..3 {
            let union: Vec<usize> = (0..16).filter(|e| (e + round) % 2 == 0).collect();
            src.begin_layer(l, &union);
            for &e in &union {
                check(&src.expert(l, e).unwrap(), &want[&(l, e)]);
            }
        }
    }
    let before = src.stats().unwrap();
    src.begin_layer(1, &[2, 5]);
    src.begin_layer(2, &[9]);
    let after = src.stats().unwrap();
    let t = |s: &ExpertStats| s.total();
    assert_eq!(t(&after).hits - t(&before).hits, 3);
    assert_eq!(t(&after).pinned_hits - t(&before).pinned_hits, 3);
    assert_eq!(t(&after).misses, t(&before).misses);
    assert!(after.cache_peak_bytes <= 6 * eb);
    assert_eq!(after.pin_budget_bytes, 3 * eb);
    assert!(after.summary_line().contains("pinned_hits="));
}

#[test]
fn seeded_heat_keeps_historically_hot_experts_through_a_scan() {
    let dir = tempfile::tempdir().unwrap();
    let (table, _) = fixture(dir.path(), 2, 16);
    // Read expert 3 once, then scan the 12 experts 4…15 three times, two per pass, through
    // a 4-expert cache: by the third scan they are hotter than an unseeded expert 3.
    let run = |seed: bool| {
        let src =
            StreamingExperts::new(table.clone(), opts(4, &table, PilotGate::Measure)).unwrap();
        if seed {
            src.seed_heat(&[((1, 3), 0.9), ((1, 99), 1.0), ((0, 0), 1.0)], 4.0);
        }
        src.begin_layer(1, &[3]);
        src.expert(1, 3).unwrap();
        for _ in 0..3 {
            for pair in [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15].chunks(2) {
                src.begin_layer(1, pair);
                for &e in pair {
                    src.expert(1, e).unwrap();
                }
            }
        }
        let before = src.stats().unwrap().total().hits;
        src.begin_layer(1, &[3]);
        src.stats().unwrap().total().hits - before
    };
    assert_eq!(run(true), 1, "the seeded expert stayed resident");
    assert_eq!(run(false), 0, "without a seed the scan evicts it");
}

#[test]
fn direct_io_refusal_falls_back_to_buffered_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (table, want) = fixture(dir.path(), 2, 4);
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Measure)).unwrap();
    let before = src.io_path();
    eprintln!("io path on {}: {before}", dir.path().display());
    src.files()[0]
        .fail_next_direct_read
        .store(true, Ordering::Relaxed);
    check(&src.expert(1, 0).unwrap(), &want[&(1, 0)]);
    let after = src.io_path();
    assert!(after.starts_with("buffered"), "{after}");
    if before == "direct" {
        assert!(after.contains("refused at read"), "{after}");
    }
    check(&src.expert(1, 3).unwrap(), &want[&(1, 3)]);
    let st = src.stats().unwrap();
    assert_eq!(st.direct_reads, 0);

    let off = StreamOptions {
        direct_io: DirectIo::Off,
        ..opts(2, &table, PilotGate::Measure)
    };
    let src = StreamingExperts::new(table, off).unwrap();
    check(&src.expert(1, 2).unwrap(), &want[&(1, 2)]);
    assert!(src.io_path().starts_with("buffered"));
}

#[test]
fn bad_storage_is_an_error_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let (table, _) = fixture(dir.path(), 2, 4);
    let e = StreamingExperts::new(
        table.clone(),
        StreamOptions {
            cache_bytes: 100,
            ..opts(1, &table, PilotGate::Off)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot hold one expert"), "{e}");

    let mut short = table.clone();
    if let Some(Some(l)) = short.layers.get_mut(1) {
        l[2].ranges[3].1 -= 1;
    }
    let e = StreamingExperts::new(short, opts(2, &table, PilotGate::Off))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("expert 2 of layer 1") && e.contains("tensor 3"),
        "{e}"
    );

    // A NaN scale byte and a truncated file.
    let path = table.files[0].clone();
    let mut bytes = std::fs::read(&path).unwrap();
    let loc = table.get(1, 1).unwrap().clone();
    bytes[loc.ranges[1].0 as usize] = 255;
    std::fs::write(&path, &bytes).unwrap();
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
    let e = src.expert(1, 1).unwrap_err().to_string();
    assert!(e.contains("NaN") && e.contains("experts.1.w1"), "{e}");
    let last = table.get(1, 3).unwrap().ranges[5];
    bytes.truncate((last.0 + 10) as usize);
    std::fs::write(&path, &bytes).unwrap();
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
    let e = src.expert(1, 3).unwrap_err().to_string();
    assert!(e.contains("experts.bin") && e.contains("layer 1"), "{e}");
    assert!(
        src.expert(0, 0)
            .unwrap_err()
            .to_string()
            .contains("not a MoE layer")
    );
}

/// Open descriptors of this process (Linux).
fn open_fds() -> Option<usize> {
    std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

#[test]
fn per_expert_files_stay_open_in_a_bounded_cache() {
    let dir = tempfile::tempdir().unwrap();
    let n = MAX_OPEN_FILES + 44;
    let (mut table, want) = fixture(dir.path(), 2, n);
    // One file per expert (links to the same bytes), as a stream install has.
    table.files = (0..n)
        .map(|e| {
            let p = dir.path().join(format!("L1-E{e}.bin"));
            std::fs::hard_link(&table.files[0], &p).unwrap();
            p
        })
        .collect();
    if let Some(Some(locs)) = table.layers.get_mut(1) {
        for (e, l) in locs.iter_mut().enumerate() {
            l.file = e;
        }
    }
    let src = StreamingExperts::new(table.clone(), opts(2, &table, PilotGate::Off)).unwrap();
    // Small pieces: an expert is many reads, all through one open of its file.
    src.set_read_piece_bytes(4096).unwrap();
    let before = open_fds();
    let mut peak = 0;
    for e in 0..n {
        check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
        peak = peak.max(open_fds().unwrap_or(0));
    }
    assert_eq!(src.files_opened(), n as u64, "one open per expert file");
    // Read again, the most recent first: they are still open (a cache of two experts'
    // buffers re-reads them, but opens nothing).
    for e in (n - OPEN_FILE_CACHE..n).rev() {
        check(&src.expert(1, e).unwrap(), &want[&(1, e)]);
    }
    assert_eq!(src.files_opened(), n as u64);
    // The oldest was closed and is opened again.
    check(&src.expert(1, 0).unwrap(), &want[&(1, 0)]);
    assert_eq!(src.files_opened(), n as u64 + 1);
    if let Some(before) = before {
        // Two descriptors per cached file at most, plus the readers' transient ones and
        // slack for the tests running beside this one.
        let bound = before + 2 * OPEN_FILE_CACHE + 2 * 2 + 64;
        assert!(peak <= bound, "{peak} descriptors open, bound {bound}");
    }
}
