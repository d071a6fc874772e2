#!/usr/bin/env bash
# rlserve against PyTorch and llama.cpp on this machine: builds rlserve, sets the peers up
# (benches/peers/setup.sh, once), then benches/compare.py runs every pair back to back,
# alternating, and prints medians and ratios. Run it on an idle machine.
#
#   benches/compare.sh [compare.py flags: --reps 3 --only train,train-rl,latency,batched,serve --threads N]
#
# PEERS_DIR (default .peers) holds the peers; PEERS_VENV reuses a venv that has torch.
set -euo pipefail
cd "$(dirname "$0")/.."
peers="${PEERS_DIR:-$PWD/.peers}"
cargo build -q -p server
./target/debug/rlserve fetch-model >/dev/null
benches/peers/setup.sh "$peers" >/dev/null
py="${PEERS_VENV:-$peers/venv}/bin/python"
exec python3 benches/compare.py --peers "$peers" --python "$py" "$@"
