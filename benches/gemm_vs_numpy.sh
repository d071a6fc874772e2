#!/usr/bin/env bash
# The GEMMs of the default model, rlserve (criterion, benches/benches/gemm.rs) and numpy/OpenBLAS
# sgemm (benches/sgemm_numpy.py) back to back, then one table with GFLOP/s and the ratio.
# Run on an otherwise idle machine (check `uptime`); both sides use all cores.
#   benches/gemm_vs_numpy.sh [PYTHON] [criterion filter, e.g. 'gemm/fwd_m512']
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
filter=${2:-gemm}
target=${CARGO_TARGET_DIR:-target}
cargo bench -p benches --bench gemm -- "$filter"
"$python" benches/sgemm_numpy.py --criterion "$target/criterion"
