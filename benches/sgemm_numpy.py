#!/usr/bin/env python3
"""numpy/OpenBLAS sgemm on the shapes of `benches/benches/gemm.rs` (keep the two lists equal).

Forward: y [m, n] = x [m, k] @ W[n, k].T; weight gradient: dW [n, k] = dy[m, n].T @ x [m, k];
input gradient: dx [m, k] = dy [m, n] @ W [n, k] (each one sgemm call with a transpose flag,
no copies). Prints one line per
(pass, m, shape) with the median of `--reps` timings and GFLOP/s (2·m·n·k FLOP per call), and
with `--criterion DIR` (criterion's output folder, `$CARGO_TARGET_DIR/criterion`) also prints
the median GFLOP/s of the last `cargo bench -p benches --bench gemm` run on each shape and the
ratio rlserve / numpy (`benches/gemm_vs_numpy.sh` runs both back to back).
Threads: OpenBLAS's default (all cores); set OPENBLAS_NUM_THREADS to change it.
"""
import argparse
import json
import os
import time

import numpy as np

ROWS = [1, 64, 158, 512, 2048]
# (name, n, k) of the default model (SmolLM2-135M): hidden 576, 9 heads and 3 KV heads of
# 64, intermediate 1536, vocabulary 49152.
SHAPES = [
    ("q_proj", 576, 576),
    ("kv_proj", 192, 576),
    ("up_proj", 1536, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
]


def median_seconds(f, reps, budget_s=2.0):
    """Median of at least 3 and at most `reps` timings, stopping early past `budget_s`."""
    f()  # warm-up (and first-touch of the output)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < reps and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--criterion", help="criterion output folder to compare against")
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS, help="row counts to run (default: all)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for m in args.rows:
        for pass_ in ("fwd", "dw", "dx"):
            for name, n, k in SHAPES:
                x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
                if pass_ == "fwd":
                    w = rng.uniform(-1, 1, (n, k)).astype(np.float32)
                    out = np.empty((m, n), np.float32)
                    f = lambda: np.matmul(x, w.T, out=out)  # noqa: E731
                elif pass_ == "dx":
                    w = rng.uniform(-1, 1, (n, k)).astype(np.float32)
                    dy = rng.uniform(-1, 1, (m, n)).astype(np.float32)
                    out = np.empty((m, k), np.float32)
                    f = lambda: np.matmul(dy, w, out=out)  # noqa: E731
                else:
                    dy = rng.uniform(-1, 1, (m, n)).astype(np.float32)
                    out = np.empty((n, k), np.float32)
                    f = lambda: np.matmul(dy.T, x, out=out)  # noqa: E731
                s = median_seconds(f, args.reps)
                gflops = 2 * m * n * k / s / 1e9
                line = f"{pass_:3} m={m:<5} {name:9} {n:>5}x{k:<5} numpy {s * 1e3:10.3f} ms {gflops:7.1f} GFLOP/s"
                if args.criterion:
                    ours = criterion_seconds(args.criterion, pass_, m, name, n, k)
                    if ours:
                        line += f" | rlserve {ours * 1e3:10.3f} ms {2 * m * n * k / ours / 1e9:7.1f} GFLOP/s | ratio {s / ours:5.2f}"
                print(line, flush=True)


def criterion_seconds(folder, pass_, m, name, n, k):
    """Median seconds of benches/benches/gemm.rs's benchmark of this shape, or None."""
    path = os.path.join(folder, f"gemm_{pass_}_m{m}", name, f"{n}x{k}", "new", "estimates.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)["median"]["point_estimate"] / 1e9


if __name__ == "__main__":
    main()
