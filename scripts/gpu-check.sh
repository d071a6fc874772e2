#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (H100 or H200: NVIDIA driver, nvcc, PyTorch and
# transformers; no Rust toolchain, no network). Run from the repository root:
#     bash scripts/gpu-check.sh
# with gpu-bin/ carried from the build machine (bash scripts/gpu-build.sh builds it there).
# Under 8 minutes; prints one summary table; exits non-zero if any check fails.
#
#  1. nvidia-smi; finds libcuda, libnvrtc and libcublas (the usual paths, then the Python
#     packages of the PyTorch install) and exports LD_LIBRARY_PATH. rlserve's CUDA binding
#     (cudarc) opens `lib<name>.so` first, so each found library is linked under that name
#     into $WORK/lib (a CUDA 13 install ships `libcublas.so.13`, a name cudarc 0.19 does
#     not try).
#  2. Random-weight model folders of real shapes (scripts/make_random_model.py):
#     SmolLM2-135M's config and Qwen2-0.5B's.
#  3. The integration binary: `conformance` (every op, CUDA vs f64 references) and
#     `cuda_e2e::gpu_vs_cpu` (GPU engine and learner vs the CPU's). A test that prints
#     "no CUDA device" counts as a failure here.
#  4. rlserve bench latency (with decode graphs, then --enforce-eager) / throughput (batch
#     64; at Qwen2-0.5B also nano-vllm's offline shape, 256 sequences of 100–1024 tokens in
#     and out) / train with --device cuda on both
#     models (the CLI's default --dtype auto: bf16 serving copies of the linear weights,
#     f32 master weights and an f32 backward), and derived figures: % of the HBM roof at
#     batch 1 (bytes of bf16 weights read per token × decode tokens/s ÷ HBM bandwidth), % of
#     the bf16 peak of the serving GEMM FLOPs and % of the FP32 peak of the learner step's
#     (lower bounds on the GEMMs' own efficiency: the step's other kernels count as GEMM
#     time). Beside each: the device counters per decode step (copies, allocations,
#     launches, syncs), and PyTorch + transformers on the same folders and workloads
#     (scripts/torch_peer.py: prefill, batch-1 and batch-64 decode in bf16, an f32 train
#     step with AdamW) with the ratio rlserve / PyTorch and the GPU-engine issue's target.
#  5. Per-kernel time tables (Nsight Compute) of an eager decode and a training step
#     (scripts/kernel_table.py), kept in the logs.
#  6. Online RL: a three-step `rlserve train --device cuda` job (GRPO on SmolLM2-135M's
#     shapes): its steps, policy versions and the engine's pause per update.
#
# Peaks assumed, by the name nvidia-smi gives (NVIDIA datasheets; dense tensor-core figures;
# rlserve's cuBLAS SGEMMs run in the default math mode: FP32, no TF32):
#   H200 (SXM)               HBM3e 4.8 TB/s,  FP32 67 TFLOPS, BF16 989.5 TFLOPS
#   H200 NVL                 HBM3e 4.8 TB/s,  FP32 60 TFLOPS, BF16 835 TFLOPS
#   H100 80GB HBM3 (SXM)     HBM3 3.35 TB/s,  FP32 67 TFLOPS, BF16 989.5 TFLOPS
#   H100 NVL                 HBM3 3.9 TB/s,   FP32 60 TFLOPS, BF16 835 TFLOPS
#   H100 PCIe                HBM2e 2.0 TB/s,  FP32 51 TFLOPS, BF16 756 TFLOPS
# Another GPU gets the H200's figures and a note row saying so. Override any of them with
# GPU_HBM_TBPS, GPU_FP32_TFLOPS and GPU_BF16_TFLOPS.
#
# Environment: GPU_BIN (default gpu-bin), GPU_WORK (default /tmp/gpu-check: models, PTX
# cache, library links; logs too unless $OUT is set: then $OUT/gpu-check-logs), PYTHON
# (default python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

BIN=${GPU_BIN:-gpu-bin}
WORK=${GPU_WORK:-/tmp/gpu-check}
# Logs go to $OUT (what a device run brings back) when it is set; the models stay out of it.
if [[ -n "${OUT:-}" ]]; then LOGS=$OUT/gpu-check-logs; else LOGS=$WORK/logs; fi
PYTHON=${PYTHON:-python3}
START=$SECONDS

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: nvidia-smi not found: this machine has no NVIDIA driver. Run this script on a GPU" >&2
    echo "machine, with gpu-bin/ built here by scripts/gpu-build.sh and carried there." >&2
    exit 2
fi
for b in rlserve integration; do
    if [[ ! -x "$BIN/$b" ]]; then
        echo "gpu-check: $BIN/$b missing: build it with scripts/gpu-build.sh and carry $BIN/" >&2
        exit 2
    fi
done
mkdir -p "$WORK/lib" "$LOGS" "$WORK/models"
export RLSERVE_CUDA_CACHE="$WORK/ptx"

ROWS=()
FAILED=0
# record NAME ok|note|FAIL DETAIL (a note is a caveat, not a failure)
record() {
    ROWS+=("| $1 | $2 | ${3//|/\\|} |")
    [[ "$2" == ok || "$2" == note ]] || FAILED=1
    echo "== $1: $2 $3"
}
elapsed() { echo "$((SECONDS - START)) s"; }
# budget LIMIT: the seconds a step may take: LIMIT, or less when the 470 s budget (8 minutes
# less a margin) runs out; a step cut short exits 124 (timeout) and is a failure.
budget() {
    local left=$((470 - (SECONDS - START)))
    if ((left < $1)); then echo "$((left > 1 ? left : 1))"; else echo "$1"; fi
}

# ---- 1. driver and libraries ----
if smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
    record "nvidia-smi" ok "$(head -n 1 <<<"$smi")"
else
    record "nvidia-smi" FAIL "$smi"
fi
smi=$(head -n 1 <<<"$smi")
# peaks NAME: "HBM_TB/s FP32_TFLOPS BF16_TFLOPS LABEL" for a GPU name (the table above).
peaks() {
    case "$1" in
        *H200*NVL*) echo "4.8 60 835 H200-NVL" ;;
        *H200*) echo "4.8 67 989.5 H200-SXM" ;;
        *H100*NVL*) echo "3.9 60 835 H100-NVL" ;;
        *H100*PCIe*) echo "2.0 51 756 H100-PCIe" ;;
        *H100*) echo "3.35 67 989.5 H100-SXM" ;;
        *) echo "4.8 67 989.5 unknown" ;;
    esac
}
read -r hbm fp32 bf16 PEAKS_OF <<<"$(peaks "${smi%%,*}")"
HBM_TBPS=${GPU_HBM_TBPS:-$hbm}
FP32_TFLOPS=${GPU_FP32_TFLOPS:-$fp32}
BF16_TFLOPS=${GPU_BF16_TFLOPS:-$bf16}
if [[ "$PEAKS_OF" == unknown && -z "${GPU_HBM_TBPS:-}${GPU_FP32_TFLOPS:-}${GPU_BF16_TFLOPS:-}" ]]; then
    record "peaks" note "no datasheet figures for '${smi%%,*}': % of peak uses the H200's; set GPU_HBM_TBPS, GPU_FP32_TFLOPS, GPU_BF16_TFLOPS"
fi

site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
dirs=(/usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/local/cuda/lib64
    /usr/local/cuda/targets/x86_64-linux/lib)
for d in /usr/local/cuda-*/lib64; do [[ -d "$d" ]] && dirs+=("$d"); done
if [[ -n "$site" && -d "$site/nvidia" ]]; then
    while IFS= read -r d; do dirs+=("$d"); done < <(find "$site/nvidia" -maxdepth 3 -type d -name lib | sort)
fi
# The newest lib<name>.so[.N...] in the first directory that has one.
find_lib() {
    local d f
    for d in "${dirs[@]}"; do
        f=$(find "$d" -maxdepth 1 -regex ".*/lib$1\.so\(\.[0-9]+\)*" 2>/dev/null | sort -V | tail -n 1)
        if [[ -n "$f" ]]; then
            echo "$f"
            return 0
        fi
    done
    ldconfig -p 2>/dev/null | awk -v n="lib$1.so" '$1 ~ "^" n {print $NF; exit}'
}
libpath=""
for name in cuda nvrtc cublas; do
    f=$(find_lib "$name")
    if [[ -z "$f" ]]; then
        record "lib$name" FAIL "not found in ${dirs[*]} or ldconfig"
        continue
    fi
    ln -sf "$(readlink -f "$f")" "$WORK/lib/lib$name.so"
    libpath="$libpath:$(dirname "$f")"
    record "lib$name" ok "$f"
done
export LD_LIBRARY_PATH="$WORK/lib$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# ---- 2. random-weight models ----
MODELS=(smollm2-135m qwen2-0.5b)
for m in "${MODELS[@]}"; do
    if timeout "$(budget 120)" "$PYTHON" scripts/make_random_model.py "$WORK/models/$m" --config "$m" >"$LOGS/make-$m.log" 2>&1; then
        record "model $m" ok "$(tail -n 1 "$LOGS/make-$m.log") ($(elapsed))"
    else
        record "model $m" FAIL "see $LOGS/make-$m.log: $(tail -n 1 "$LOGS/make-$m.log")"
    fi
done

# ---- 3. integration tests on the GPU ----
for filter in conformance cuda_e2e::gpu_vs_cpu; do
    log="$LOGS/test-${filter//:/_}.log"
    # The emulated-device variants (`*cuda_emu*`, `*::emu`) already ran in CI: GPU time is for the GPU.
    timeout "$(budget 150)" "$BIN/integration" "$filter" --skip emu --nocapture >"$log" 2>&1
    rc=$?
    summary=$(grep -E '^test result:' "$log" | tail -n 1)
    if ((rc != 0)); then
        record "tests $filter" FAIL "exit $rc: ${summary:-no result line}; failures: $(grep -E '^test .* FAILED$' "$log" | tr '\n' ' ')"
    elif grep -q "no CUDA device" "$log"; then
        record "tests $filter" FAIL "skipped on the GPU: $(grep -m 1 'no CUDA device' "$log")"
    else
        record "tests $filter" ok "$summary ($(elapsed))"
    fi
done
# The measurements the GPU-vs-CPU tests print, one row per model: the worst logits error
# over the prefill and decode steps, ℓ and gradient errors, |ℓ − μ|, greedy divergences.
e2e="$LOGS/test-cuda_e2e__gpu_vs_cpu.log"
if [[ -f "$e2e" ]]; then
    # --nocapture puts a test's first printed line after its `test NAME ... `.
    sed -E 's/^test [^ ]+ \.\.\. //' "$e2e" >"$LOGS/e2e-lines.txt"
    # One row per model and device mode ("smollm2-135m (CudaDevice(0, bf16))": f32 and bf16 apart).
    awk '/: step [0-9]+ .*max relative error/ { e = $NF + 0; k = $0; sub(/: step .*/, "", k); if (!(k in w) || e > w[k]) w[k] = e }
        END { for (m in w) printf "%s logits (prefill + 4 decode steps): max relative error %.2e\n", m, w[m] }' "$LOGS/e2e-lines.txt" |
        sort >"$LOGS/measured.txt"
    grep -hE 'worst gradient|max \|ℓ − μ\||diverges' "$LOGS/e2e-lines.txt" | sort -u >>"$LOGS/measured.txt"
    while IFS= read -r line; do record "measured" ok "$line"; done <"$LOGS/measured.txt"
fi

# ---- 4. benchmarks on the GPU ----
# json KEY MODEL: a value of the model folder's roof.json.
json() { "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$WORK/models/$2/roof.json" "$1"; }
# pct RATE PER_ITEM PEAK: 100 · RATE · PER_ITEM / PEAK.
pct() { "$PYTHON" -c 'import sys; r, p, k = map(float, sys.argv[1:]); print(f"{100 * r * p / k:.1f}")' "$1" "$2" "$3"; }
# bench NAME MODEL ARGS...: runs `rlserve bench` with a time limit; the log is $LOGS/NAME-MODEL.log.
bench() {
    local name=$1 m=$2
    shift 2
    local log="$LOGS/$name-$m.log"
    timeout "$(budget 75)" "$BIN/rlserve" bench "$name" --device cuda --model "$WORK/models/$m" "$@" >"$log" 2>&1
    local rc=$?
    if ((rc != 0)); then
        record "bench $name $m" FAIL "exit $rc: $(tail -n 1 "$log")"
    fi
    return "$rc"
}
for m in "${MODELS[@]}"; do
    [[ -f "$WORK/models/$m/roof.json" ]] || continue
    # roof.json counts f32 weights; the serving copy is bf16 (half the bytes).
    bytes=$(($(json bytes_per_token "$m") / 2))
    fwd=$(json flops_per_token_forward "$m")
    train=$(json flops_per_token_train "$m")
    pp="" tg="" out="" tps=""
    if bench latency "$m" --prompt-tokens 512 --gen-tokens 128 --repetitions 3; then
        log="$LOGS/latency-$m.log"
        pp=$(awk -F'|' '$4 ~ /pp512/ {gsub(/ /, "", $5); print $5}' "$log")
        tg=$(awk -F'|' '$4 ~ /tg128/ {gsub(/ /, "", $5); print $5}' "$log")
        l=$(grep -m 1 '^Device per' "$log") && record "device counters $m" ok "$l"
        record "bench latency $m" ok "pp512 $pp tok/s, tg128 $tg tok/s = $(pct "$tg" "$bytes" "${HBM_TBPS}e12")% of the HBM roof ($((bytes / 1000000)) MB of bf16 weights per token)"
    fi
    # The same decode without CUDA graphs (--enforce-eager): what the graphs buy at batch 1.
    if [[ -n "$tg" ]] && bench latency "$m" --prompt-tokens 512 --gen-tokens 128 --repetitions 3 --enforce-eager; then
        cp "$LOGS/latency-$m.log" "$LOGS/latency-eager-$m.log"
        eager=$(awk -F'|' '$4 ~ /tg128/ {gsub(/ /, "", $5); print $5}' "$LOGS/latency-eager-$m.log")
        record "decode graphs $m" ok "tg128 with graphs $tg tok/s, eager $eager tok/s, ratio $("$PYTHON" -c 'import sys; a, b = map(float, sys.argv[1:]); print(f"{a / b:.2f}")' "$tg" "$eager")"
    fi
    if bench throughput "$m" --num-prompts 64 --input-len 128 --output-len 64 --max-num-seqs 64 --no-curve; then
        line=$(grep -m 1 '^Throughput:' "$LOGS/throughput-$m.log")
        total=$(sed -E 's/.* ([0-9.]+) total tokens\/s.*/\1/' <<<"$line")
        out=$(sed -E 's/.* ([0-9.]+) output tokens\/s.*/\1/' <<<"$line")
        decode=$(sed -nE 's/^Decode phase: ([0-9.]+) output tokens\/s.*/\1/p' "$LOGS/throughput-$m.log")
        record "bench throughput $m" ok "batch 64: $out output tok/s, $total total tok/s = $(pct "$total" "$fwd" "${BF16_TFLOPS}e12")% of bf16 peak (2N FLOPs/token); decode phase $decode output tok/s"
        l=$(grep -m 1 '^Device per' "$LOGS/throughput-$m.log") && record "device counters $m" ok "$l"
    fi
    # The offline-throughput target's shape (nano-vllm's benchmark: 256 sequences, input and
    # output lengths uniform in 100–1024), at Qwen2-0.5B's shapes only.
    [[ -f "$LOGS/throughput-$m.log" ]] && cp "$LOGS/throughput-$m.log" "$LOGS/throughput-64-$m.log"
    if [[ "$m" == qwen2-0.5b ]] && bench throughput "$m" --num-prompts 256 --input-len 562 --output-len 562 \
        --random-range-ratio 0.822 --max-num-seqs 256 --max-num-batched-tokens 16384 --no-curve; then
        cp "$LOGS/throughput-$m.log" "$LOGS/throughput-offline-$m.log"
        line=$(grep -m 1 '^Throughput:' "$LOGS/throughput-offline-$m.log")
        offline=$(sed -E 's/.* ([0-9.]+) output tokens\/s.*/\1/' <<<"$line")
        record "offline throughput $m" ok "256 sequences, lengths uniform in 100–1024: $offline output tok/s; target ≥ 30000"
    fi
    if bench train "$m" --num-seqs 8 --prompt-len 128 --completion-len 128 --steps 2; then
        line=$(grep -m 1 '^fwd+bwd+AdamW:' "$LOGS/train-$m.log")
        tps=$(sed -E 's/.*, ([0-9.]+) tokens\/s.*/\1/' <<<"$line")
        record "bench train $m" ok "8 × 256 tokens: ${line#fwd+bwd+AdamW: } = $(pct "$tps" "$train" "${FP32_TFLOPS}e12")% of FP32 peak (6N FLOPs/token); $(grep -m 1 '^split' "$LOGS/train-$m.log")"
    fi
    # PyTorch + transformers on the same folder, same workloads (scripts/torch_peer.py), the
    # ratio rlserve / PyTorch beside each; the GPU-engine issue's targets quoted for Qwen2-0.5B.
    plog="$LOGS/torch-$m.log"
    timeout "$(budget 150)" "$PYTHON" scripts/torch_peer.py "$WORK/models/$m" >"$plog" 2>&1
    rc=$?
    if ((rc != 0)); then
        record "torch peer $m" FAIL "exit $rc: $(tail -n 1 "$plog")"
        continue
    fi
    # peer LABEL RLSERVE_VALUE TORCH_LINE_PREFIX TARGET: one row with the ratio.
    peer() {
        local t
        t=$(sed -nE "s/^torch $3: ([0-9.]+) .*/\1/p" "$plog" | head -n 1)
        if [[ -z "$2" || -z "$t" ]]; then
            record "vs PyTorch $1 $m" FAIL "rlserve '${2}', PyTorch '${t}' (see $plog)"
            return
        fi
        record "vs PyTorch $1 $m" ok "rlserve $2, PyTorch $t tok/s: $("$PYTHON" -c "print(f'{$2 / $t:.2f}')")x; $4"
    }
    peer "prefill 512" "$pp" "prefill" "no target"
    peer "decode batch 1" "$tg" "decode batch 1" "target ≥ 1000 tok/s at Qwen2-0.5B shapes, bf16"
    peer "decode batch 64" "$out" "decode batch 64" "no target (the offline row has it)"
    peer "train step 8 × 256" "$tps" "train step" "target ≥ 1.0x PyTorch"
done

# ---- 5. where the time goes: per-kernel tables of a decode step and a training step ----
# Nsight Compute (`ncu --clock-control none`: the clocks as they run) times every kernel of
# a short eager decode (SmolLM2-135M shapes: 8 decode steps after a 16-token prefill) and of
# one small training step; scripts/kernel_table.py sums them per kernel name and per step.
if command -v ncu >/dev/null 2>&1 && [[ -d "$WORK/models/smollm2-135m" ]]; then
    # profile NAME STEPS ARGS...: ncu over `rlserve ARGS`, the table per STEPS steps.
    profile() {
        local name=$1 steps=$2
        shift 2
        local csv="$LOGS/ncu-$name.csv"
        timeout "$(budget 120)" ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
            --print-units base --launch-count 4000 "$BIN/rlserve" "$@" >"$csv" 2>"$LOGS/ncu-$name.err"
        local rc=$?
        if ((rc != 0)); then
            record "kernel table $name" FAIL "ncu exit $rc: $(tail -n 1 "$LOGS/ncu-$name.err")"
            return
        fi
        "$PYTHON" scripts/kernel_table.py "$csv" --steps "$steps" >"$LOGS/kernels-$name.md" 2>&1 &&
            record "kernel table $name" ok "$(head -n 1 "$LOGS/kernels-$name.md") (table: $LOGS/kernels-$name.md)" ||
            record "kernel table $name" FAIL "$(tail -n 1 "$LOGS/kernels-$name.md")"
    }
    profile decode 9 bench latency --device cuda --model "$WORK/models/smollm2-135m" --prompt-tokens 16 \
        --gen-tokens 8 --repetitions 1 --enforce-eager
    profile train 1 bench train --device cuda --model "$WORK/models/smollm2-135m" --num-seqs 2 --prompt-len 64 \
        --completion-len 64 --steps 1
else
    record "kernel tables" FAIL "ncu not found on PATH (or no model): no per-kernel times"
fi

# ---- 6. online RL on the GPU: a short `rlserve train` job ----
# Three GRPO steps on SmolLM2-135M's shapes (random weights): the engine samples, the
# learner commits its prepared weights under the write guard; the pause per update (the
# longer of the guard's hold and the guarded pass's device time, CUDA events) comes from
# metrics.jsonl. Target: ≤ 1 ms (at Qwen2-0.5B).
rl="$WORK/rl"
rm -rf "$rl" && mkdir -p "$rl"
printf '{"prompt": "abc"}\n{"prompt": "xyz"}\n' >"$rl/data.jsonl"
cat >"$rl/job.toml" <<EOF_JOB
model = "$WORK/models/smollm2-135m"
dataset = "$rl/data.jsonl"
apply_chat_template = false
num_generations = 8
prompts_per_step = 2
max_steps = 3
output_dir = "$rl/run"
rewards = [{ type = "regex", pattern = '^[a-z]' }]
[learner]
max_completion_length = 16
EOF_JOB
timeout "$(budget 120)" "$BIN/rlserve" train --config "$rl/job.toml" --no-serve --device cuda >"$LOGS/rl-train.log" 2>&1
rc=$?
if ((rc != 0)); then
    record "rlserve train (GPU)" FAIL "exit $rc: $(tail -n 1 "$LOGS/rl-train.log")"
else
    cat >"$rl/pauses.py" <<'EOF_PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if r.get("kind") == "train"]
ms = [round(1e3 * r["pause_seconds"], 3) for r in rows]
print(f"{len(rows)} steps, policy versions {[r['version'] for r in rows]}, pause per update {ms} ms")
EOF_PY
    pauses=$("$PYTHON" "$rl/pauses.py" "$rl/run/metrics.jsonl" 2>&1)
    record "rlserve train (GPU)" ok "$pauses; target pause ≤ 1 ms"
fi

# ---- summary ----
echo
echo "gpu-check on: $smi ($(elapsed)); logs in $LOGS"
echo "peaks assumed: HBM ${HBM_TBPS} TB/s, FP32 ${FP32_TFLOPS} TFLOPS, BF16 ${BF16_TFLOPS} TFLOPS (datasheet: $PEAKS_OF, unless GPU_HBM_TBPS, GPU_FP32_TFLOPS or GPU_BF16_TFLOPS set)"
echo "| check | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${ROWS[@]}"
if ((FAILED)); then
    echo "gpu-check: FAILED"
    exit 1
fi
echo "gpu-check: all checks passed"
