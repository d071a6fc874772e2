#!/usr/bin/env python3
"""The `rlserve bench train` step in PyTorch on CPU, for comparison (not run by CI;
benches/compare.sh runs it against rlserve).

    python3 -m pip install torch transformers safetensors numpy
    python3 benches/train_step_torch.py models/SmolLM2-135M-Instruct [--threads 2] [--hf]

Same model weights (f32), same batch shape (8 × (128 + 128) random tokens), same work:
forward over prompt + completion, GRPO token-level clipped loss on the completion tokens
(ratios 1, advantages ±1), backward, gradient clipping, AdamW step. The model is either
this file's own functional Llama (default) or, with `--hf`, the Hugging Face
`AutoModelForCausalLM` class (sdpa attention), what TRL trains. Prints s/step, tokens/s
and peak RSS.
"""
import argparse, json, os, resource, time
import numpy as np
import torch
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--num-seqs", type=int, default=8)
ap.add_argument("--prompt-len", type=int, default=128)
ap.add_argument("--completion-len", type=int, default=128)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--hf", action="store_true", help="the transformers model class instead of the functional model")
a = ap.parse_args()
torch.set_num_threads(a.threads)
cfg = json.load(open(os.path.join(a.model, "config.json")))
H, NH, NKV, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
D, EPS, THETA, V = H // NH, cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"]
p = {k: torch.nn.Parameter(v.float()) for k, v in load_file(os.path.join(a.model, "model.safetensors")).items()}


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, n, t):
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x = x.view(x.shape[0], t, n, D)
    rot = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos[None, :, None] + rot * sin[None, :, None]


def logits(tokens):
    b, t = tokens.shape
    x = p["model.embed_tokens.weight"][tokens]
    for l in range(L):
        q = f"model.layers.{l}."
        n1 = rms(x, p[q + "input_layernorm.weight"])
        Q = rope(n1 @ p[q + "self_attn.q_proj.weight"].T, NH, t).transpose(1, 2)
        K = rope(n1 @ p[q + "self_attn.k_proj.weight"].T, NKV, t).transpose(1, 2)
        Vv = (n1 @ p[q + "self_attn.v_proj.weight"].T).view(b, t, NKV, D).transpose(1, 2)
        K, Vv = K.repeat_interleave(NH // NKV, 1), Vv.repeat_interleave(NH // NKV, 1)
        att = torch.nn.functional.scaled_dot_product_attention(Q, K, Vv, is_causal=True)
        x = x + att.transpose(1, 2).reshape(b, t, H) @ p[q + "self_attn.o_proj.weight"].T
        n2 = rms(x, p[q + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(n2 @ p[q + "mlp.gate_proj.weight"].T) * (n2 @ p[q + "mlp.up_proj.weight"].T)) @ p[q + "mlp.down_proj.weight"].T
    x = rms(x, p["model.norm.weight"])
    return x @ p.get("lm_head.weight", p["model.embed_tokens.weight"]).T


if a.hf:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32, attn_implementation="sdpa")
    hf.train()
    p = dict(hf.named_parameters())

    def logits(tokens):  # noqa: F811 (the HF model replaces the functional one)
        return hf(input_ids=tokens, use_cache=False).logits


rng = np.random.default_rng(0)
tokens = torch.tensor(rng.integers(100, V, (a.num_seqs, a.prompt_len + a.completion_len)))
inputs, targets = tokens[:, :-1], tokens[:, a.prompt_len:]
adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(a.num_seqs)])[:, None]
opt = torch.optim.AdamW(p.values(), lr=1e-6, weight_decay=0.0)
times = []
for step in range(a.steps + 1):
    t0 = time.perf_counter()
    z = logits(inputs)[:, a.prompt_len - 1:]
    lp = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]
    ratio = torch.exp(lp - lp.detach())
    loss = (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).mean(-1).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(p.values(), 1.0)
    opt.step()
    if step > 0:
        times.append(time.perf_counter() - t0)
secs = sorted(times)[len(times) // 2]
n_tok = a.num_seqs * (a.prompt_len + a.completion_len)
print(f"PyTorch {torch.__version__}{' + transformers (HF model class)' if a.hf else ''}, {a.threads} threads: {secs:.2f} s/step, {n_tok / secs:.1f} tokens/s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
