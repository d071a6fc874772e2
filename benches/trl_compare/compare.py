#!/usr/bin/env python3
"""Prints the reward curves of the TRL run (runs/trl.jsonl, from trl_grpo.py) and the rlserve
job (runs/trl_parity/metrics.jsonl) side by side, with the rolling 10-step means and the
wall-clock, and draws both curves to runs/trl_compare.png (matplotlib, labelled axes)."""
import json, sys

trl_path = sys.argv[1] if len(sys.argv) > 1 else "runs/trl.jsonl"
rl_path = sys.argv[2] if len(sys.argv) > 2 else "runs/trl_parity/metrics.jsonl"
trl = [json.loads(l) for l in open(trl_path)]
rl = [r for r in map(json.loads, open(rl_path)) if "reward" in r and "eval_reward" not in r]


def rolling(v, k=10):
    return [sum(v[max(0, i - k + 1): i + 1]) / len(v[max(0, i - k + 1): i + 1]) for i in range(len(v))]


t_r, r_r = [x["reward"] for x in trl], [x["reward"] for x in rl]
t_m, r_m = rolling(t_r), rolling(r_r)
print(f"{'step':>4} {'TRL':>6} {'TRL10':>6} {'rlserve':>8} {'rl10':>6}")
for i in range(max(len(t_r), len(r_r))):
    cell = lambda v, j: f"{v[j]:.3f}" if j < len(v) else "-"
    print(f"{i + 1:>4} {cell(t_r, i):>6} {cell(t_m, i):>6} {cell(r_r, i):>8} {cell(r_m, i):>6}")


def first_at(m, x=0.9):
    return next((i + 1 for i, v in enumerate(m) if v >= x), None)


t_secs = sum(x["seconds"] for x in trl)
r_secs = sum(x.get("step_seconds", 0.0) for x in rl)
print(f"rolling-10 mean >= 0.9 first at step: TRL {first_at(t_m)}, rlserve {first_at(r_m)}")
print(f"mean reward over the last 20 steps: TRL {sum(t_r[-20:]) / max(1, len(t_r[-20:])):.3f}, "
      f"rlserve {sum(r_r[-20:]) / max(1, len(r_r[-20:])):.3f}")
print(f"wall-clock: TRL {t_secs:.0f} s ({t_secs / max(1, len(trl)):.1f} s/step), "
      f"rlserve {r_secs:.0f} s ({r_secs / max(1, len(rl)):.1f} s/step)")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(t_r) + 1), t_r, color="tab:blue", alpha=0.3, label="TRL reward")
    ax.plot(range(1, len(t_m) + 1), t_m, color="tab:blue", label="TRL rolling-10 mean")
    ax.plot(range(1, len(r_r) + 1), r_r, color="tab:orange", alpha=0.3, label="rlserve reward")
    ax.plot(range(1, len(r_m) + 1), r_m, color="tab:orange", label="rlserve rolling-10 mean")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (first number = a + b)")
    ax.set_title("GRPO (dapo) on SmolLM2-135M-Instruct: TRL vs rlserve")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig("runs/trl_compare.png", dpi=100)
    print("plot: runs/trl_compare.png")
except ImportError:
    print("(matplotlib not installed: no plot)")
