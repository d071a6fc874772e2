#!/usr/bin/env bash
# Builds here (no GPU or CUDA toolkit needed: cudarc loads the CUDA libraries at run time) the
# two binaries scripts/gpu-check.sh runs on a lent GPU machine, which has no Rust toolchain:
#   gpu-bin/rlserve      the server binary with the `cuda` feature
#   gpu-bin/integration  the integration-test binary with the tests crate's `cuda` feature
# Both are stripped and must fit the 64 MiB a device run can carry; the script checks that
# and prints the carry list. gpu-bin/ is gitignored.
#
# Usage: bash scripts/gpu-build.sh   (honours CARGO_TARGET_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."

limit_mib=64
out=gpu-bin

# One feature set for both (the workspace's default members), so they share every artifact.
features=tests/cuda,server/cuda
cargo build --quiet --bins --tests --features "$features"
# The integration binary's path is in cargo's JSON messages (its name carries a hash).
test_bin=$(cargo test --quiet --features "$features" --no-run --message-format=json |
    jq -r 'select(.reason == "compiler-artifact" and .target.name == "integration" and .executable != null) | .executable' |
    tail -n 1)
target=${CARGO_TARGET_DIR:-target}
[[ -x "$test_bin" ]] || { echo "gpu-build: no integration test binary found" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
cp "$target/debug/rlserve" "$out/rlserve"
cp "$test_bin" "$out/integration"
strip "$out/rlserve" "$out/integration"

total=$(du -cb "$out/rlserve" "$out/integration" | tail -n 1 | cut -f 1)
ls -l "$out"
printf 'total %.1f MiB (limit %d MiB)\n' "$(echo "$total / 1048576" | bc -l)" "$limit_mib"
if ((total > limit_mib * 1048576)); then
    echo "gpu-build: the binaries exceed ${limit_mib} MiB together" >&2
    exit 1
fi
echo 'carry: ["gpu-bin"]'
echo 'then, on the GPU machine: bash scripts/gpu-check.sh'
