#!/usr/bin/env python3
"""Per-seed summary of TRL and rlserve reward curves on the parity task:
    seeds.py SEED TRL.jsonl RLSERVE_METRICS.jsonl [SEED TRL.jsonl RLSERVE.jsonl ...]
For each side: the first step whose rolling 10-step mean reward (over a full window) is
>= 0.9, and the mean reward of the last 20 steps; then whether rlserve got there within
1.2x TRL's steps."""
import json, sys


def rewards(path):
    rows = [json.loads(l) for l in open(path)]
    return [r.get("reward_mean", r.get("reward")) for r in rows
            if r.get("kind", "train") == "train" and "eval_reward" not in r]


def first_at(r, k=10, x=0.9):
    return next((i + 1 for i in range(k - 1, len(r)) if sum(r[i - k + 1:i + 1]) / k >= x), None)


a = sys.argv[1:]
print(f"{'seed':>4} | {'TRL >=0.9 at':>12} {'last20':>6} | {'rlserve >=0.9 at':>16} {'last20':>6} | within 1.2x")
for i in range(0, len(a), 3):
    seed, t, o = a[i], rewards(a[i + 1]), rewards(a[i + 2])
    ft, fo = first_at(t), first_at(o)
    ok = fo is not None and (ft is None or fo <= 1.2 * ft)
    fmt = lambda f, n: f"{f}" if f is not None else f"never ({n} steps)"
    print(f"{seed:>4} | {fmt(ft, len(t)):>12} {sum(t[-20:]) / max(1, len(t[-20:])):>6.2f} | "
          f"{fmt(fo, len(o)):>16} {sum(o[-20:]) / max(1, len(o[-20:])):>6.2f} | {'yes' if ok else 'no'}")
