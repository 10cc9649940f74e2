//! Generations sharing one model through a [`Batcher`] (decode steps in batches, prefills and
//! verifications in exclusive turns) emit, bit for bit, what each emits alone: the same ids,
//! the same logit of every chosen token and the same top logits and log-sum-exp, for greedy,
//! seeded sampling and drafted generation, whatever runs beside them, including one that is
//! interrupted midway.

mod common;

use common::Replay;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deltafin_k3::generate::StopReason;
use deltafin_k3::model::K3Model;
use deltafin_k3::sampling::{Sampler, Sampling};
use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use deltafin_spec::{Batcher, Event, Generation, SpecPolicy};

fn model() -> (tempfile::TempDir, K3Model) {
    common::small_model(5)
}

/// One step's ids, the bits of K3's logit for the last, its top logits and log-sum-exp.
type StepBits = (Vec<u32>, Option<u32>, Vec<(u32, u32)>, u64);

/// What a generation reported, as bits: per committed id, the id, the bits of K3's logit for
/// it (when K3 chose it) and of the step's top logits and log-sum-exp.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    ids: Vec<u32>,
    steps: Vec<StepBits>,
    stop: StopReason,
}

/// How one generation runs.
#[derive(Clone)]
struct Job {
    prompt: Vec<u32>,
    max_new: usize,
    /// Seeded sampling instead of greedy.
    seed: Option<u64>,
    /// Drafted by a replay of its own solo ids (wrong from the 6th on).
    draft: Option<Vec<u32>>,
    /// Raise the interrupt after this many committed steps.
    interrupt_after: Option<usize>,
    /// Start this long after the others.
    delay_ms: u64,
}

fn run(m: &K3Model, job: &Job, batcher: Option<&Batcher>) -> Record {
    let mut sampler = job
        .seed
        .map(|s| Sampler(Sampling::new(0.8, 40, 0.95, 0.0, s).unwrap()));
    let mut replay = job.draft.as_ref().map(|run| Replay {
        run: run.clone(),
        wrong_from: job.prompt.len() + 6,
        asked: 0,
    });
    let mut policy = SpecPolicy::fixed(3);
    let interrupt = AtomicBool::new(false);
    let mut g = Generation::new(m, &job.prompt)
        .stop_ids(vec![])
        .max_new(Some(job.max_new))
        .top_logits(3)
        .interrupt(&interrupt);
    if let Some(s) = sampler.as_mut() {
        g = g.rule(s);
    }
    if let Some(r) = replay.as_mut() {
        g = g.drafter(r, &mut policy);
    }
    if let Some(b) = batcher {
        g = g.batcher(b);
    }
    let mut steps = Vec::new();
    let done = g
        .run(|ev| {
            if let Event::Committed(c) = ev {
                let (top, lse) = c.summary.map_or((Vec::new(), 0), |s| {
                    let top = s.top.iter().map(|&(t, l)| (t, l.to_bits())).collect();
                    (top, s.logsumexp.to_bits())
                });
                steps.push((c.ids.to_vec(), c.logit.map(f32::to_bits), top, lse));
                if job.interrupt_after.is_some_and(|n| steps.len() >= n) {
                    interrupt.store(true, Ordering::Relaxed);
                }
            }
            Ok(())
        })
        .unwrap();
    Record {
        ids: done.ids,
        steps,
        stop: done.stop,
    }
}

/// `jobs` each alone, then all at once on one batcher (each on its own thread, started after
/// its delay): every record is its solo record; returns the batcher's counters' largest batch.
fn check_together(m: &K3Model, jobs: &[Job]) -> usize {
    let solo: Vec<Record> = jobs.iter().map(|j| run(m, j, None)).collect();
    let batcher = Batcher::new();
    let together: Vec<Record> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|j| {
                let batcher = &batcher;
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(j.delay_ms));
                    run(m, j, Some(batcher))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        if jobs[i].draft.is_some() {
            // A drafted step commits several ids at once; compare the ids only here, and
            // the per-step bits against the plain solo run below.
            assert_eq!(a.ids, b.ids, "job {i}: drafted ids differ beside others");
        } else {
            assert_eq!(a, b, "job {i}: differs when run beside others");
        }
    }
    let stats = batcher.stats();
    assert_eq!(stats.members, 0, "every generation left the batcher");
    stats.largest
}

fn job(prompt_len: usize, salt: u32, max_new: usize) -> Job {
    Job {
        prompt: (0..prompt_len as u32)
            .map(|i| (i * 37 + salt * 101 + 5) % 1000 + 3)
            .collect(),
        max_new,
        seed: None,
        draft: None,
        interrupt_after: None,
        delay_ms: 0,
    }
}

#[test]
fn greedy_generations_together_equal_each_alone() {
    let (_d, m) = model();
    for n in 1..=4 {
        let jobs: Vec<Job> = (0..n)
            .map(|i| job([3, 70, 1, 130][i], i as u32, 24 + 3 * i))
            .collect();
        let largest = check_together(&m, &jobs);
        if n > 1 {
            assert!(largest >= 2, "{n} generations never decoded in one batch");
        }
    }
}

#[test]
fn sampled_drafted_interrupted_and_late_generations_together_equal_each_alone() {
    let (_d, m) = model();
    let mut jobs = vec![
        job(9, 1, 40),
        Job {
            seed: Some(7),
            ..job(66, 2, 30)
        },
        Job {
            interrupt_after: Some(5),
            ..job(20, 3, 40)
        },
        Job {
            delay_ms: 20,
            ..job(140, 4, 12)
        },
        Job {
            seed: Some(8),
            delay_ms: 5,
            ..job(2, 5, 35)
        },
    ];
    // A drafted generation: drafts replaying its own plain ids.
    let plain = job(12, 6, 30);
    let solo = run(&m, &plain, None);
    let mut full = plain.prompt.clone();
    full.extend(&solo.ids);
    jobs.push(Job {
        draft: Some(full),
        ..plain.clone()
    });
    check_together(&m, &jobs);
    // The interrupted one stopped where it was told, alone and beside others alike.
    let alone = run(&m, &jobs[2], None);
    assert_eq!(alone.stop, StopReason::Interrupted);
    assert_eq!(alone.steps.len(), 5);
}

#[test]
fn eight_generations_of_mixed_lengths_together_equal_each_alone() {
    let (_d, m) = model();
    let jobs: Vec<Job> = (0..8)
        .map(|i| Job {
            seed: (i % 3 == 1).then_some(100 + i as u64),
            delay_ms: (i as u64 % 4) * 3,
            ..job(
                [1, 64, 65, 2, 129, 7, 33, 200][i],
                10 + i as u32,
                10 + 2 * i,
            )
        })
        .collect();
    let largest = check_together(&m, &jobs);
    assert!(largest >= 2, "eight generations never decoded in one batch");
}

/// Under a memory budget, with the routed experts and all but one spine layer streamed from
/// disk (a streamed spine's pass holds its reader, so a prefill there keeps its turn for the
/// whole prompt): still each generation's solo bits, and no deadlock.
#[test]
fn generations_together_over_a_streamed_spine_and_experts_equal_each_alone() {
    use deltafin_k3::engine::{EngineBuilder, EngineConfig};
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), &SynthSpec::new(SynthDims::tiny_streaming(), 3)).unwrap();
    let config = EngineConfig {
        spine_resident_layers: Some(1),
        ..EngineConfig::default()
    };
    let engine = EngineBuilder::new(dir.path())
        .config(config)
        .memory_budget(Some(110_000_000))
        .runtime_bytes(50_000_000)
        .build()
        .unwrap();
    let m = &engine.model;
    assert!(m.experts.stats().is_some(), "the experts stream");
    assert!(m.spine_stream.is_some(), "the spine streams");
    let vocab = m.dims.vocab_size as u32;
    let jobs: Vec<Job> = (0..4)
        .map(|i| {
            let mut j = job([4, 70, 1, 20][i], 30 + i as u32, 10 + 2 * i);
            j.prompt.iter_mut().for_each(|t| *t %= vocab);
            j.seed = (i == 2).then_some(3);
            j.delay_ms = i as u64 * 2;
            j
        })
        .collect();
    let largest = check_together(m, &jobs);
    assert!(largest >= 2, "four generations never decoded in one batch");
}
