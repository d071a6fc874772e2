#!/usr/bin/env bash
# The parity task (examples/trl_parity.toml) on several seeds, TRL's GRPOTrainer and the
# rlserve job back to back per seed, then one table: per seed and side, the first step at
# which the rolling 10-step mean reward reaches 0.9, the mean over the last 20 steps and over
# the run, and whether rlserve reaches it within 1.2× TRL's steps (the parity issue's target). Not run by
# CI; set-up as run.sh (a venv with torch, transformers, trl). STALENESS overrides the
# example's max_staleness on the rlserve side.
#   VENV=.venv-trl SEEDS="0 1 2" STEPS=80 benches/trl_compare/seeds.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv-trl}"
SEEDS="${SEEDS:-0 1 2}"
STEPS="${STEPS:-80}"
cargo build -q -p server
model="$(target/debug/rlserve fetch-model)"
out=runs/seeds
mkdir -p "$out"
for s in $SEEDS; do
  "$VENV/bin/python" benches/trl_compare/trl_grpo.py --model "$model" --out "$out/trl-$s.jsonl" --seed "$s" \
    --steps "$STEPS" >"$out/trl-$s.log" 2>&1
  sed -e "s/^seed = .*/seed = $s/" -e "s/^max_steps = .*/max_steps = $STEPS/" \
    -e "s|^output_dir = .*|output_dir = \"$out/rlserve-$s\"|" examples/trl_parity.toml >"$out/job-$s.toml"
  [ -n "${STALENESS:-}" ] && sed -i "s/^max_staleness = .*/max_staleness = $STALENESS/" "$out/job-$s.toml"
  rm -rf "$out/rlserve-$s"
  target/debug/rlserve --threads 2 train --config "$out/job-$s.toml" --no-serve >"$out/rlserve-$s.log" 2>&1
  echo "seed $s done"
done
args=()
for s in $SEEDS; do args+=("$s" "$out/trl-$s.jsonl" "$out/rlserve-$s/metrics.jsonl"); done
python3 benches/trl_compare/seeds.py "${args[@]}"
