#!/usr/bin/env bash
# TRL vs rlserve on the parity task (examples/trl_parity.toml), back to back, then the reward
# curves side by side. Not run by CI. Set-up (PyPI): a venv with torch, transformers, trl
# and matplotlib:
#   python3 -m venv .venv-trl && .venv-trl/bin/pip install torch transformers trl matplotlib
#   VENV=.venv-trl SEED=0 benches/trl_compare/run.sh
# Check that the machine is otherwise idle first (`uptime`): the wall-clock is compared.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv-trl}"
SEED="${SEED:-0}"
model="$(cargo run -q -- fetch-model)"
uptime
mkdir -p runs
"$VENV/bin/python" benches/trl_compare/trl_grpo.py --model "$model" --out runs/trl.jsonl --seed "$SEED"
sed "s/^seed = .*/seed = $SEED/" examples/trl_parity.toml > runs/trl_parity.toml
rm -rf runs/trl_parity
cargo run -q -- --threads 2 train --config runs/trl_parity.toml --no-serve
"$VENV/bin/python" benches/trl_compare/compare.py runs/trl.jsonl runs/trl_parity/metrics.jsonl
