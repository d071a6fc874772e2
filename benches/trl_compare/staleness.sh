#!/usr/bin/env bash
# Off-policy learning on a task, per max_staleness and seed (the staleness issue's table):
# for each seed, one run per staleness value back to back (alternating, so machine drift
# spreads over all of them), then benches/trl_compare/staleness.py prints, per staleness and
# seed, the first step whose rolling 10-step mean reward is >= 0.9, the last-20 and run mean
# rewards, seconds per step, and per staleness the median first step against the on-policy
# one. Not run by CI (80 steps × 5 seeds × 4 values is about an hour on 2 cores; check
# `uptime` first: timings need an idle machine).
#   CONFIG=examples/trl_parity.toml SEEDS="0 1 2 3 4" STALENESS="0 1 2 4" benches/trl_compare/staleness.sh
# THRESHOLD replaces the 0.9 of the summary's first step (staleness.py --threshold).
# EXTRA adds lines to every job's [learner] table (e.g. EXTRA='off_policy_correction = "ppo_clip"').
# AHEAD sets the job's generate_ahead (default "as_needed"; "to_max_staleness": every batch as
# stale as the bound allows).
# SAMPLE_SEED_OFFSET repeats the runs on the same prompts with other samples: a run's
# data_seed is its seed from SEEDS and its seed (the sampling) that plus the offset. Runs of
# one seed in several OUT folders average with `staleness.py --repeats`.
set -euo pipefail
cd "$(dirname "$0")/../.."
CONFIG="${CONFIG:-examples/trl_parity.toml}"
SEEDS="${SEEDS:-0 1 2 3 4}"
STALENESS="${STALENESS:-0 1 2 4}"
OUT="${OUT:-runs/staleness}"
cargo build -q -p server
target/debug/rlserve fetch-model >/dev/null
mkdir -p "$OUT"
uptime
for s in $SEEDS; do
  for k in $STALENESS; do
    d="$OUT/k$k-s$s"
    rm -rf "$d"
    seed="$s"
    [ -n "${SAMPLE_SEED_OFFSET:-}" ] && seed="$((s + SAMPLE_SEED_OFFSET))\ndata_seed = $s"
    sed -e "s/^seed = .*/seed = $seed/" -e "s|^output_dir = .*|output_dir = \"$d\"|" \
      -e "s/^max_staleness = .*/max_staleness = $k/" "$CONFIG" >"$OUT/job-k$k-s$s.toml"
    grep -q '^max_staleness' "$OUT/job-k$k-s$s.toml" || echo "max_staleness = $k" >>"$OUT/job-k$k-s$s.toml"
    [ -n "${AHEAD:-}" ] && sed -i "1i generate_ahead = \"$AHEAD\"" "$OUT/job-k$k-s$s.toml"
    [ -n "${EXTRA:-}" ] && printf '%b\n' "$EXTRA" >>"$OUT/job-k$k-s$s.toml"
    target/debug/rlserve --threads 2 train --config "$OUT/job-k$k-s$s.toml" --no-serve >"$OUT/log-k$k-s$s.txt" 2>&1
    rm -rf "$d"/checkpoint-*   # the run's final checkpoint: 1.6 GB each, not needed for the table
    echo "staleness $k seed $s done"
  done
done
python3 benches/trl_compare/staleness.py "$OUT" ${THRESHOLD:+--threshold "$THRESHOLD"}
