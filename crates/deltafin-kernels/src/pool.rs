//! Keeping the worker pool awake during a generation.
//!
//! A decoded token is a few hundred parallel loops of 10–300 µs each (one per matrix product
//! group, one per MoE layer). Between two of them the other rayon workers go idle, and a
//! rayon worker that finds no work for a few dozen rounds parks on a futex: waking it for the
//! next product costs a system call on both sides and, in a VM, an inter-processor
//! interrupt — tens of microseconds per hand-off, a sizeable share of a 30 ms token on two
//! cores.
//!
//! [`run_warm`] runs a closure on a pool worker while every *other* worker of the pool runs a
//! keep-warm loop: it takes pending pool work as soon as it appears ([`rayon::yield_now`]
//! steals from the other workers' queues) and, when there is none, spins briefly and then
//! yields its CPU to any other runnable thread (`sched_yield`) instead of parking; after
//! 20 ms without work (a generation blocked on a slow client) it naps 200 µs at a time. Products
//! therefore start on both cores within a fraction of a microsecond. The loops end when the
//! closure returns (or unwinds). A loop's end is not waited for: [`run_warm`] returns when its
//! closure does, and a loop a busy worker only gets to later ends at once. (Ending a loop
//! after a 20 ms stall instead of napping cost decode 10%: a stall during a long prefill left
//! the whole decode without its loops.)
//!
//! Scheduling only: which thread runs a row range never changes a value (see the products'
//! determinism contract in `matvec`), so results are bit-identical with and without it.
//!
//! The kernel setting `pool_spin` (default on; binaries read it from `DELTAFIN_POOL_SPIN`)
//! switches it; off runs the closure on a pool worker exactly like `rayon::scope` with
//! nothing else.
//!
//! **One warm session at a time.** A keep-warm loop is a job that only ends when its closure
//! returns, and a worker that waits (a join, an MoE slot) runs its pending jobs on top of
//! what it was doing. With two sessions at once (two engines in one process, two servers in
//! one test binary), each worker could end up running the *other* session's loop on top of
//! its own closure: each loop then waits for a closure buried under the other — a deadlock
//! (seen with two test servers on two cores). So at most one session in the process keeps
//! the pool warm; a [`run_warm`] that starts while another runs calls its closure directly
//! on the calling thread (its parallel loops still use the pool, as any caller's do), and
//! one nested inside a session does the same. (A loop can still sit on top of another
//! engine's job on a worker; that job then waits until the session ends, which only happens
//! with two engines in one process.)

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Idle rounds a keep-warm loop spins (`pause`, ≈ 2 ms in all) before it starts yielding its
/// CPU each round.
const SPIN_ROUNDS: u32 = 2048;
/// Idle time after which a keep-warm loop naps instead of yielding: far longer than any gap
/// between two products of a token, far shorter than a human-visible delay.
const NAP_AFTER: std::time::Duration = std::time::Duration::from_millis(20);
/// One nap: the most a product can wait for this worker after a long stall.
const NAP: std::time::Duration = std::time::Duration::from_micros(200);

/// Run `f` on a worker of the current rayon pool; with `spin`, the pool's other workers run
/// keep-warm loops until `f` returns — unless another warm session runs in the process (or
/// this call is nested in one): then `f` runs directly on the calling thread. Returns `f`'s
/// value; a panic in `f` is re-raised after the loops have stopped.
pub fn run_warm_with<R: Send>(spin: bool, f: impl FnOnce() -> R + Send) -> R {
    if !spin {
        return rayon::scope(|_| f());
    }
    // Another session (or this one, nested) keeps the pool warm: run `f` here.
    let Some(_session) = Session::take() else {
        return f();
    };
    rayon::scope(|_| {
        let stop = Arc::new(AtomicBool::new(false));
        if rayon::current_num_threads() > 1 {
            let me = rayon::current_thread_index();
            let loops_stop = Arc::clone(&stop);
            // Not scoped: returning does not wait for a worker that is busy elsewhere (or
            // blocked) to take its loop; a loop that starts after `stop` ends at once.
            rayon::spawn_broadcast(move |ctx| {
                if Some(ctx.index()) != me {
                    keep_warm(&loops_stop);
                }
            });
        }
        let r = catch_unwind(AssertUnwindSafe(f));
        stop.store(true, Ordering::Release);
        match r {
            Ok(r) => r,
            Err(panic) => resume_unwind(panic),
        }
    })
}

/// Whether a warm session runs in this process (see the module documentation).
static WARM_SESSION: AtomicBool = AtomicBool::new(false);

/// The process's one warm session, held until dropped (on a panic too).
struct Session;

impl Session {
    fn take() -> Option<Session> {
        WARM_SESSION
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(Session)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        WARM_SESSION.store(false, Ordering::Release);
    }
}

/// [`run_warm_with`] switched by the installed kernel setting `pool_spin`.
pub fn run_warm<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    run_warm_with(crate::settings::current().pool_spin, f)
}

/// Take pool work as it appears until `stop`; while there is none: spin, then yield the CPU,
/// and after a long stall (the generation thread blocked on a slow client or a disk read)
/// nap, so a stalled generation does not keep a core busy.
fn keep_warm(stop: &AtomicBool) {
    let mut idle = 0u32;
    let mut idle_since: Option<std::time::Instant> = None;
    let mut prefetcher = crate::lookahead::Prefetcher::default();
    while !stop.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle = 0;
            idle_since = None;
            continue;
        }
        if prefetcher.step() {
            continue;
        }
        if idle < SPIN_ROUNDS {
            idle += 1;
            for _ in 0..16 {
                std::hint::spin_loop();
            }
            continue;
        }
        let since = *idle_since.get_or_insert_with(std::time::Instant::now);
        if since.elapsed() < NAP_AFTER {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn runs_parallel_work_and_returns_with_spinners_stopped() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for spin in [true, false] {
                let hits = AtomicUsize::new(0);
                let sum = pool.install(|| {
                    run_warm_with(spin, || {
                        let mut total = 0u64;
                        for round in 0..50u64 {
                            total += (0..1000u64)
                                .into_par_iter()
                                .map(|i| {
                                    hits.fetch_add(1, Ordering::Relaxed);
                                    i * round
                                })
                                .sum::<u64>();
                        }
                        total
                    })
                });
                assert_eq!(sum, (0..50u64).map(|r| r * 499_500).sum::<u64>());
                assert_eq!(hits.load(Ordering::Relaxed), 50_000);
                // The pool is usable afterwards (no worker stuck in a loop).
                let after: u64 = pool.install(|| (0..100u64).into_par_iter().sum());
                assert_eq!(after, 4950);
            }
        }
    }

    /// CPU time (user + system, clock ticks) of this process's threads named `name`.
    #[cfg(target_os = "linux")]
    fn cpu_ticks_of(name: &str) -> u64 {
        let mut total = 0;
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() != name {
                continue;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            total += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        }
        total
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_stalled_generation_does_not_keep_a_core_busy() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .thread_name(|i| format!("warmstall-{i}"))
            .build()
            .unwrap();
        let ticks = |pool: &rayon::ThreadPool| {
            pool.broadcast(|_| ());
            cpu_ticks_of("warmstall-0") + cpu_ticks_of("warmstall-1")
        };
        let before = ticks(&pool);
        // The generation thread blocks for 1 s (as on a slow client); the other worker spins
        // about 2 ms, yields up to 20 ms, then naps.
        pool.install(|| {
            run_warm_with(true, || {
                std::thread::sleep(std::time::Duration::from_secs(1))
            })
        });
        let used = ticks(&pool) - before;
        // Clock ticks are 10 ms: without the naps the keep-warm loop would use ≈ 100.
        assert!(
            used <= 30,
            "keep-warm loop used {used} ticks of CPU in a 1 s stall"
        );
    }

    /// Two warm sessions at once on one pool: the second must not wait for a keep-warm loop
    /// of its own that the first session's (blocked) closure keeps from running. Before one
    /// session per process, this deadlocked: the second session's loop was queued for the
    /// worker that runs the first session's closure, and the first waits for the second.
    #[test]
    fn a_second_session_during_a_blocked_first_one_finishes() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<u64>();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|sc| {
            let pool = &pool;
            sc.spawn(move || {
                pool.install(move || {
                    run_warm_with(true, move || {
                        // The first session's closure blocks its worker until the second
                        // session has finished (or the test gives up).
                        let _ = go_rx.recv_timeout(std::time::Duration::from_secs(20));
                    })
                })
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            sc.spawn(move || {
                let sum: u64 =
                    pool.install(|| run_warm_with(true, || (0..10_000u64).into_par_iter().sum()));
                let _ = done_tx.send(sum);
            });
            let got = done_rx.recv_timeout(std::time::Duration::from_secs(10));
            let _ = go_tx.send(());
            assert_eq!(
                got.ok(),
                Some(49_995_000),
                "the second warm session did not finish while the first was blocked"
            );
        });
    }

    #[test]
    fn a_panic_is_re_raised_after_the_loops_stop() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| run_warm_with(true, || -> u32 { panic!("inside") }))
        }));
        let msg = r.unwrap_err();
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"inside"));
        assert_eq!(pool.install(|| run_warm_with(true, || 7)), 7);
    }
}
