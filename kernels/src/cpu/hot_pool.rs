//! Keeping the rayon pool awake through a chain of small parallel ops.
//!
//! A decode step is ~120 parallel products of 0.05–1 ms each with short serial ops between
//! them (norms, RoPE, cache writes, residual adds). An idle rayon worker spins ~32 rounds of
//! `sched_yield` and then sleeps on a futex, so between two products it often falls asleep,
//! and the next product pays a futex wake and the vCPU's wake-up latency before its second
//! half starts (single-sequence decode on 2 threads: 26 futex calls and ~800 `sched_yield`s
//! per token, the products taking 16.3 ms per token in place against 14 ms back to back).
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
    let r = f();
    done.store(true, Ordering::Release);
    r
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
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}
