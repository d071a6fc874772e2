#!/usr/bin/env bash
# Prefill (pp512) and decode (tg128) tokens/s of rlserve and llama.cpp on the same weights
# (the default model, F32), same thread count, printed side by side.
#
#   benches/llama_cpp_compare.sh [THREADS]
#
# llama.cpp: `llama-bench` and `llama-quantize` when on PATH; otherwise llama-cpp-python
# (set PYTHON to an interpreter that has it: `pip install llama-cpp-python`).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
models=${RLSERVE_MODELS_DIR:-models}
cargo build -q -p server
rlserve=target/debug/rlserve
$rlserve fetch-model >/dev/null
q41="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
f32="$models/SmolLM2-135M-Instruct.F32.gguf"
py=${PYTHON:-python3}

if [ ! -f "$f32" ]; then
  if command -v llama-quantize >/dev/null; then
    llama-quantize --allow-requantize "$q41" "$f32" F32
  else
    "$py" - "$q41" "$f32" <<'PY'
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32; p.allow_requantize = True
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)) == 0
PY
  fi
fi

echo "== rlserve =="
$rlserve --threads "$threads" bench latency --prompt-tokens 512 --gen-tokens 128 --repetitions 3
echo "== llama.cpp =="
if command -v llama-bench >/dev/null; then
  llama-bench -m "$f32" -t "$threads" -p 512 -n 128 -r 3
else
  "$py" benches/llama_cpp_bench.py "$f32" --threads "$threads" --prompt-tokens 512 --gen-tokens 128 --repetitions 3
fi
