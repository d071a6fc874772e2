#!/usr/bin/env bash
# Wall-clock per step of the parity job (examples/trl_parity.toml): TRL's GRPOTrainer
# (trl_grpo.py) and the rlserve job, STEPS steps each, alternating REPS times (TRL, rlserve,
# TRL, rlserve, ...). Per run: the mean seconds per step after the first (model load and
# warm-up excluded on both sides); then the medians and the ratio rlserve / TRL (the
# parity issue's target: ≤ 1/3), and the same for the steady state: the per-step medians
# from step FROM on (default 13). TRL's first dozen steps run about 40 % slower than its
# later ones, even where those are longer (seed 0: 8.5 s at 11 tokens in steps 2–12, 6.0 s at
# 16 tokens in steps 41–80), so a short run overstates rlserve's lead: use STEPS ≥ 40 for the steady
# figure (below FROM + 5 steps it falls back to step 3). Refuses to start above MAX_LOAD
# (a peer timed on a busy machine is not a comparison). Set-up as run.sh (a venv with
# torch, transformers, trl):
#   VENV=.venv-trl STEPS=40 REPS=2 SEED=2 benches/trl_compare/wall.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv-trl}"
STEPS="${STEPS:-8}"
REPS="${REPS:-2}"
SEED="${SEED:-2}"
FROM="${FROM:-13}"
cargo build -q -p server
model="$(target/debug/rlserve fetch-model)"
load=$(cut -d' ' -f1 /proc/loadavg)
if awk -v l="$load" -v m="${MAX_LOAD:-0.5}" 'BEGIN { exit !(l > m) }'; then
  echo "load average $load > MAX_LOAD ${MAX_LOAD:-0.5}: stop builds, servers and helpers first" >&2
  exit 1
fi
out=runs/wall
mkdir -p "$out"
sed -e "s/^seed = .*/seed = $SEED/" -e "s/^max_steps = .*/max_steps = $STEPS/" \
  -e "s|^output_dir = .*|output_dir = \"$out/rlserve\"|" examples/trl_parity.toml >"$out/job.toml"
for r in $(seq 1 "$REPS"); do
  "$VENV/bin/python" benches/trl_compare/trl_grpo.py --model "$model" --out "$out/trl-$r.jsonl" --seed "$SEED" \
    --steps "$STEPS" >"$out/trl-$r.log" 2>&1
  echo "TRL run $r done, load $(cut -d' ' -f1 /proc/loadavg)"
  rm -rf "$out/rlserve"
  target/debug/rlserve --threads 2 train --config "$out/job.toml" --no-serve >"$out/rlserve-$r.log" 2>&1
  cp "$out/rlserve/metrics.jsonl" "$out/rlserve-$r.jsonl"
  echo "rlserve run $r done, load $(cut -d' ' -f1 /proc/loadavg)"
done
python3 - "$out" "$REPS" "$FROM" <<'PY'
import json, statistics, sys
out, reps, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def lines(p, kind=None):
    rows = [json.loads(l) for l in open(p)]
    return [r for r in rows if kind is None or r.get("kind") == kind]
trl, ours, trl_steady, ours_steady = [], [], [], []
steps = len(lines(f"{out}/trl-1.jsonl"))
if steps < start + 5:
    print(f"only {steps} steps: the steady state below starts at step 3, where TRL is still warming up")
    start = 3
for r in range(1, reps + 1):
    t = lines(f"{out}/trl-{r}.jsonl")
    trl.append(sum(x["seconds"] for x in t[1:]) / (len(t) - 1))
    trl_steady += [x["seconds"] for x in t[start - 1:]]
    o = lines(f"{out}/rlserve-{r}.jsonl", "train")
    ours.append((o[-1]["elapsed_seconds"] - o[0]["elapsed_seconds"]) / (len(o) - 1))
    ours_steady += [b["elapsed_seconds"] - a["elapsed_seconds"] for a, b in zip(o[start - 2:], o[start - 1:])]
print("s/step after the first step, in alternation order:")
print("  TRL GRPOTrainer:", ", ".join(f"{x:.2f}" for x in trl))
print("  rlserve job:    ", ", ".join(f"{x:.2f}" for x in ours))
mt, mo = statistics.median(trl), statistics.median(ours)
print(f"medians: TRL {mt:.2f} s/step, rlserve {mo:.2f} s/step; rlserve / TRL = {mo / mt:.3f} (target ≤ 0.333)")
# Early steps pay for first touches of fresh memory (slow on some VMs) and, on TRL's side,
# warm-up that lasts about a dozen steps.
st, so = statistics.median(trl_steady), statistics.median(ours_steady)
print(f"steady state (median of the per-step times from step {start} on, all runs): TRL {st:.2f} s, "
      f"rlserve {so:.2f} s; rlserve / TRL = {so / st:.3f}")
PY
