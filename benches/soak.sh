#!/usr/bin/env bash
# Soak run: rounds of 256 concurrent streamed requests on the default model, a fifth of the
# clients disconnecting mid-stream and some sending malformed bodies. Fails on any 5xx, a
# stream that does not end cleanly, or a KV block still in use afterwards; prints the TTFT
# p50/p99 of each round.
#   SOAK_ROUNDS=10 benches/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SOAK_ROUNDS="${SOAK_ROUNDS:-3}" cargo test -p tests --test integration -- --ignored --nocapture load::soak_on_the_default_model
