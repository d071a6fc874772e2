#!/usr/bin/env bash
# Sets up the peers that benches/compare.sh runs against, from the package registries only:
#   - PyTorch + transformers (CPU) in a venv, for the learner step;
#   - llama.cpp's llama-bench, llama-batched-bench and llama-server, built from the
#     llama.cpp vendored in the llama-cpp-python sdist (PyPI);
#   - an F32 GGUF of the default model, made with that llama.cpp's convert_hf_to_gguf.py.
# Usage: benches/peers/setup.sh [PEERS_DIR]   (default: .peers at the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dir="${1:-$root/.peers}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
# PEERS_VENV: reuse a venv that already has torch (e.g. the TRL comparison's); made absolute
# before the cd below.
venv="$(realpath -m "${PEERS_VENV:-$dir/venv}")"
cd "$dir"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch transformers numpy safetensors sentencepiece scikit-build-core cmake ninja

if [ ! -x "$dir/llama/bin/llama-bench" ]; then
  sdist=$(ls llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
  if [ -z "$sdist" ]; then
    "$venv/bin/python" -m pip download -q --no-deps --no-binary llama-cpp-python --no-build-isolation llama-cpp-python -d .
    sdist=$(ls llama_cpp_python-*.tar.gz | head -1)
  fi
  src="${sdist%.tar.gz}"
  [ -d "$src" ] || tar xzf "$sdist"
  cmake="$venv/bin/cmake"
  "$cmake" -S "$src/vendor/llama.cpp" -B "$dir/llama-build" -G Ninja -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
  "$cmake" --build "$dir/llama-build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server
  mkdir -p "$dir/llama/bin"
  cp "$dir/llama-build/bin/llama-bench" "$dir/llama-build/bin/llama-batched-bench" "$dir/llama-build/bin/llama-server" "$dir/llama/bin/"
  ln -sfn "$(cd "$src/vendor/llama.cpp" && pwd)" "$dir/llama/src"
fi

model="${RLSERVE_MODELS_DIR:-$root/models}/SmolLM2-135M-Instruct"
gguf="$dir/SmolLM2-135M-Instruct-f32.gguf"
if [ ! -f "$gguf" ]; then
  [ -f "$model/config.json" ] || (cd "$root" && cargo run -q -- generate --prompt hi --max-tokens 1 >/dev/null)
  PYTHONPATH="$dir/llama/src/gguf-py" "$venv/bin/python" "$dir/llama/src/convert_hf_to_gguf.py" "$model" \
    --outtype f32 --outfile "$gguf"
fi
echo "peers ready in $dir: $venv (torch, transformers), $dir/llama/bin, $gguf"
