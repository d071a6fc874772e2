#!/usr/bin/env python3
"""Per-seed summary of TRL and rlserve reward curves on the parity task:
    seeds.py SEED TRL.jsonl RLSERVE_METRICS.jsonl [SEED TRL.jsonl RLSERVE.jsonl ...]
For each side: the first step whose rolling 10-step mean reward (over a full window) is
>= 0.9, and the mean reward of the last 20 steps; then whether rlserve got there within
1.2x TRL's steps; the mean reward over the whole run (the area under the curve, less
sensitive to one lucky step than a threshold); and a last row over all seeds (median first
step, mean of the other columns)."""
import json, sys


def rewards(path):
    rows = [json.loads(l) for l in open(path)]
    return [r.get("reward_mean", r.get("reward")) for r in rows
            if r.get("kind", "train") == "train" and "eval_reward" not in r]


def first_at(r, k=10, x=0.9):
    return next((i + 1 for i in range(k - 1, len(r)) if sum(r[i - k + 1:i + 1]) / k >= x), None)


a = sys.argv[1:]
print(f"{'seed':>4} | {'TRL >=0.9 at':>12} {'last20':>6} {'mean':>5} | {'rlserve >=0.9 at':>16} {'last20':>6} {'mean':>5} | within 1.2x")
fmt = lambda f, n: f"{f}" if f is not None else f"never ({n} steps)"
mean = lambda r: sum(r) / max(1, len(r))
rows = []
for i in range(0, len(a), 3):
    seed, t, o = a[i], rewards(a[i + 1]), rewards(a[i + 2])
    ft, fo = first_at(t), first_at(o)
    ok = fo is not None and (ft is None or fo <= 1.2 * ft)
    rows.append((t, o, ft, fo, ok))
    print(f"{seed:>4} | {fmt(ft, len(t)):>12} {mean(t[-20:]):>6.2f} {mean(t):>5.2f} | "
          f"{fmt(fo, len(o)):>16} {mean(o[-20:]):>6.2f} {mean(o):>5.2f} | {'yes' if ok else 'no'}")
if len(rows) > 1:
    # A run that never gets there counts as its length + 1 in the median.
    med = lambda fs: sorted(fs)[len(fs) // 2] if len(fs) % 2 else sum(sorted(fs)[len(fs) // 2 - 1:len(fs) // 2 + 1]) / 2
    ft = med([f if f is not None else len(t) + 1 for t, _, f, _, _ in rows])
    fo = med([f if f is not None else len(o) + 1 for _, o, _, f, _ in rows])
    avg = lambda xs: sum(xs) / len(xs)
    print(f"{'all':>4} | {ft:>12} {avg([mean(t[-20:]) for t, *_ in rows]):>6.2f} {avg([mean(t) for t, *_ in rows]):>5.2f} | "
          f"{fo:>16} {avg([mean(o[-20:]) for _, o, *_ in rows]):>6.2f} {avg([mean(o) for _, o, *_ in rows]):>5.2f} | "
          f"{sum(r[4] for r in rows)}/{len(rows)}")
