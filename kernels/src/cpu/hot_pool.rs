//! Keeping the rayon pool awake through a chain of small parallel ops.
//!
//! A decode step is ~120 parallel products of 0.05–1 ms each with short serial ops between
//! them (norms, RoPE, cache writes, residual adds). An idle rayon worker spins ~32 rounds of
//! `sched_yield` and then sleeps on a futex, so between two products it often falls asleep,
//! and the next product pays a futex wake and the vCPU's wake-up latency before its second
//! half starts (single-sequence decode on 2 threads: 61 futex calls per token; on this
//! project's 2-vCPU VM a 3-task attention call took 30 µs with the workers awake and
//! 160–370 µs with them asleep).
//! [`hot`] runs a closure on the calling worker while the pool's other workers poll for its
//! jobs without sleeping, as llama.cpp's thread pool spins between graph nodes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Runs `f` on the current thread (use it on a rayon worker, e.g. inside `rayon::scope`),
/// while up to `current_num_threads() − 1` spinners, spawned on the pool, keep the other
/// workers busy-polling for work ([`rayon::yield_now`]: they run any job of the pool, so the
/// parallel loops of `f` start on every core at once) until `f` returns. The spinners end
/// within one job after that; `f` never waits for them (they are `'static` spawns), so a
/// long job a spinner picked up does not delay the caller. Results are those of `f` alone:
/// which thread runs which job never changes a value (the kernels are batch-invariant).
pub fn hot<R>(f: impl FnOnce() -> R) -> R {
    let workers = rayon::current_num_threads();
    let owner = rayon::current_thread_index();
    let done = Arc::new(AtomicBool::new(false));
    for _ in 1..workers {
        let done = done.clone();
        rayon::spawn(move || spin(&done, owner));
    }
    // Signalled on drop: also when `f` unwinds, so no spinner outlives a panic.
    let _end = End(done);
    f()
}

/// Sets the spinners' `done` flag when dropped.
struct End(Arc<AtomicBool>);
impl Drop for End {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Spinners polling right now, in every pool of the process (counted for the tests).
#[cfg(test)]
static SPINNING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Takes a spinner off [`SPINNING`] when it ends.
#[cfg(test)]
struct Spinning;
#[cfg(test)]
impl Drop for Spinning {
    fn drop(&mut self) {
        SPINNING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Polls the pool for jobs until `done`, 64 `pause`s (a few hundred ns) between polls
/// that found nothing: polling back to back contended with the caller pushing and popping
/// its own jobs. A spinner that lands on the thread running the closure (`owner`: it popped
/// its own spawn while waiting inside a parallel loop) returns at once: spinning there would
/// block the closure it waits for.
fn spin(done: &AtomicBool, owner: Option<usize>) {
    if rayon::current_thread_index() == owner {
        return;
    }
    #[cfg(test)]
    SPINNING.fetch_add(1, Ordering::Relaxed);
    #[cfg(test)]
    let _count = Spinning;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// On pools of 1–3 workers, `hot` keeps the other workers polling while its closure runs
    /// (parallel loops and a nested `hot` inside: a spinner that lands on the closure's own
    /// thread must return, or this hangs), returns the closure's value, and its spinners end
    /// after it, also when it panics (it fails when the closure's end is never signalled).
    #[test]
    fn hot_runs_the_closure_and_releases_the_workers() {
        let want: u64 = (0..10_000u64).map(|x| x * x).sum();
        for threads in 1..=3 {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let got = pool.install(|| {
                hot(|| {
                    // The other workers are polling (they picked up their spinners).
                    wait_for_spinners(threads, threads - 1, "into the closure");
                    let a: u64 = (0..10_000u64).into_par_iter().map(|x| x * x).sum();
                    let b: u64 =
                        (0..4u64).into_par_iter().map(|_| hot(|| (0..2_500u64).into_par_iter().count() as u64)).sum();
                    (a, b)
                })
            });
            assert_eq!(got, (want, 10_000), "{threads} threads");
            wait_for_spinners(threads, 0, "after `hot` returned");
        }
        // A closure that panics still ends its spinners.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                hot(|| {
                    wait_for_spinners(2, 1, "in a closure about to panic");
                    panic!("the closure fails");
                })
            })
        }));
        assert!(unwound.is_err());
        wait_for_spinners(2, 0, "after the closure panicked");
    }

    /// Waits (10 s at most) until [`SPINNING`] is `n` (at least `n` when `n > 0`).
    fn wait_for_spinners(threads: usize, n: usize, when: &str) {
        let t = std::time::Instant::now();
        let reached = || match n {
            0 => SPINNING.load(Ordering::Relaxed) == 0,
            _ => SPINNING.load(Ordering::Relaxed) >= n,
        };
        while !reached() {
            assert!(t.elapsed().as_secs() < 10, "{threads} threads: not {n} spinners 10 s {when}");
            std::thread::yield_now();
        }
    }
}
