#!/usr/bin/env python3
"""PyTorch + transformers on the same model folder as `rlserve bench`, for the ratios that
scripts/gpu-check.sh prints beside rlserve's figures (issue targets: batch-1 decode,
batched decode, prefill, a learner step).

    python3 scripts/torch_peer.py MODEL_DIR [--device cuda|cpu] [--quick]

The model is `AutoModelForCausalLM` (sdpa attention, what TRL and verl train and what
`transformers` serves), loaded from MODEL_DIR. Inference runs in bfloat16 on CUDA (as
rlserve's `--dtype auto` serves there: bf16 weights, f32 accumulation) and in float32 on the
CPU; the training step in float32 (rlserve's learner: f32 weights, f32 backward, f32 AdamW),
TF32 off. Workloads, matching scripts/gpu-check.sh's `rlserve bench` calls:

- prefill: one forward of 1 × 512 random tokens (`bench latency --prompt-tokens 512`);
- decode, batch 1: `generate` of 128 greedy tokens after a 1-token prompt, with the
  static KV cache (`cache_implementation="static"`, transformers' fastest batch-1 path),
  tokens / s over the decode (`bench latency --gen-tokens 128`);
- decode, batch 64: `generate` of 64 greedy tokens for 64 prompts of 128 tokens (dynamic
  cache), output tokens / s over the whole call (`bench throughput --num-prompts 64
  --input-len 128 --output-len 64`);
- train step: 8 × (128 + 128) random tokens, forward, the mean log-probability of the
  completion tokens as the loss (a GRPO loss at ratio 1 and advantage 1), backward,
  `clip_grad_norm_(1.0)`, `torch.optim.AdamW` (fused on CUDA) step (`bench train
  --num-seqs 8 --prompt-len 128 --completion-len 128`), tokens / s.

Each figure is the median of `--repetitions` timed runs after one warm-up, with
`torch.cuda.synchronize()` around every timing on CUDA. Prints one `torch NAME: VALUE UNIT`
line per figure (gpu-check.sh parses them) and the versions used. `--quick` shrinks every
workload (for a CPU smoke test of the script itself).
"""
import argparse
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--repetitions", type=int, default=3)
ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
dev = torch.device(a.device)
cuda = dev.type == "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
q = 8 if a.quick else 1
PREFILL, GEN1, BATCH, IN_LEN, OUT_LEN = 512 // q, 128 // q, 64 // q, 128 // q, 64 // q
SEQS, P_LEN, C_LEN = 8 // min(q, 4), 128 // q, 128 // q


def sync():
    if cuda:
        torch.cuda.synchronize()


def timed(f):
    """Median seconds of `f()` over the repetitions, after one warm-up."""
    f()
    times = []
    for _ in range(a.repetitions):
        sync()
        t = time.perf_counter()
        f()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def load(dtype):
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation="sdpa")
    return m.to(device=dev, dtype=dtype)  # a transformers before 4.56 ignores `dtype=`


g = torch.Generator().manual_seed(0)
print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}"
      + (f" ({torch.cuda.get_device_name(dev)})" if cuda else ""))

# ---- inference ----
model = load(torch.bfloat16 if cuda else torch.float32).eval()
vocab = model.config.vocab_size
rand = lambda *shape: torch.randint(100, vocab, shape, generator=g).to(dev)
with torch.inference_mode():
    x = rand(1, PREFILL)
    s = timed(lambda: model(x))
    print(f"torch prefill: {PREFILL / s:.1f} tok/s ({PREFILL} tokens)")

    one = rand(1, 1)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    s = timed(lambda: model.generate(one, max_new_tokens=GEN1, min_new_tokens=GEN1,
                                     cache_implementation="static", **kw))
    # The prompt's forward is one token: the time is the decode's.
    print(f"torch decode batch 1: {GEN1 / s:.1f} tok/s ({GEN1} tokens, static cache)")

    xs = rand(BATCH, IN_LEN)
    s = timed(lambda: model.generate(xs, attention_mask=torch.ones_like(xs), max_new_tokens=OUT_LEN,
                                     min_new_tokens=OUT_LEN, **kw))
    print(f"torch decode batch {BATCH}: {BATCH * OUT_LEN / s:.1f} output tok/s "
          f"({BATCH} × {IN_LEN} prompt + {OUT_LEN} output tokens, prefill included)")
del model
if cuda:
    torch.cuda.empty_cache()

# ---- one learner step ----
model = load(torch.float32).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
ids = rand(SEQS, P_LEN + C_LEN)


def train_step():
    logits = model(ids[:, :-1]).logits[:, P_LEN - 1:]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P_LEN:, None]).squeeze(-1)
    loss = -lp.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


s = timed(train_step)
tokens = SEQS * (P_LEN + C_LEN)
print(f"torch train step: {tokens / s:.1f} tok/s ({s:.3f} s/step, {SEQS} × {P_LEN + C_LEN} tokens, f32, AdamW)")
