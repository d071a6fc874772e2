#!/usr/bin/env python3
"""Per-kernel time table from Nsight Compute's CSV (scripts/gpu-check.sh, step 5).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
        --print-units base rlserve ... > run.csv
    python3 scripts/kernel_table.py run.csv --steps N [--top 25]

Sums `gpu__time_duration.sum` (ns) per kernel name (templates and arguments cut off) and
prints one summary line, then a markdown table sorted by total time: calls, total µs, mean
µs, share of the total, and µs per step (total / N: N the engine or learner steps the run
made, so a row reads as "this kernel's time in one step").
"""
import argparse
import csv
import collections
import sys


def short(name: str) -> str:
    """`void foo<...>(args)` → `foo`: the name as the table groups it."""
    name = name.strip()
    for cut in ("(", "<"):
        i = name.find(cut)
        if i > 0:
            name = name[:i]
    return name.split()[-1] if name.split() else name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    lines = open(a.csv, encoding="utf-8", errors="replace").read().splitlines()
    # ncu prints its own messages (==PROF== ...) and the program's output around the CSV.
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print(f"no ncu CSV header in {a.csv}", file=sys.stderr)
        print(f"no ncu CSV header in {a.csv}")
        return 1
    rows = list(csv.DictReader(l for l in lines[start:] if l.startswith('"')))
    total = collections.Counter()
    calls = collections.Counter()
    for r in rows:
        try:
            ns = float(r.get("gpu__time_duration.sum", "").replace(",", ""))
        except ValueError:
            continue  # the units row
        k = short(r.get("Kernel Name", "?"))
        total[k] += ns
        calls[k] += 1
    if not total:
        print("no kernel times in the CSV")
        return 1
    all_ns = sum(total.values())
    steps = max(a.steps, 1)
    print(
        f"{sum(calls.values())} kernels ({len(total)} names), {all_ns / 1e6:.2f} ms on the GPU, "
        f"{all_ns / 1e3 / steps:.0f} µs per step over {steps} steps; top: "
        + ", ".join(f"{k} {100 * v / all_ns:.0f}%" for k, v in total.most_common(3))
    )
    print()
    print("| kernel | calls | total µs | mean µs | share | µs per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in total.most_common(a.top):
        print(
            f"| {k} | {calls[k]} | {v / 1e3:.1f} | {v / 1e3 / calls[k]:.2f} | {100 * v / all_ns:.1f}% "
            f"| {v / 1e3 / steps:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
