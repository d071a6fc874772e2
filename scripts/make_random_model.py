#!/usr/bin/env python3
"""Writes an HF model folder with random weights of a real architecture, for GPU checks
where the real weights cannot be carried (scripts/gpu-check.sh).

    python3 scripts/make_random_model.py OUT_DIR --config smollm2-135m|qwen2-0.5b

Writes `config.json`, `model.safetensors` (bf16: rlserve converts to f32 at load),
`tokenizer.json` + `tokenizer_config.json`, and `roof.json` (the figures gpu-check.sh derives
its bandwidth and FLOP percentages from).

Configs: `smollm2-135m` is SmolLM2-135M-Instruct's config.json (the default model);
`qwen2-0.5b` is Qwen2-0.5B's config.json (hidden 896, 24 layers, GQA 14/2, q/k/v biases,
vocab 151936, tied). Weights: transformers' own initialisation (`from_config`: normal with
`initializer_range` 0.02, norms 1), seeded.

Tokenizer: the integration tests' tiny byte-level tokenizer (tests/src/tiny.rs,
`write_tokenizer`): the 256 byte symbols, no merges, plus `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` (ids 256-258), built with `tokenizers`. Benchmarks use random token ids, so
only encoding/decoding text is affected: ids above 258 decode to nothing.

roof.json: `matmul_params` = weights read by the GEMMs of one token (every linear layer plus
the LM head; the embedding is a row gather), `bytes_per_token` = 4 · that (rlserve holds
f32 weights on the device; KV-cache and activation traffic left out, so the roof is
optimistic for rlserve), `flops_per_token_forward` = 2 · matmul_params (Kaplan et al. 2020,
"Scaling Laws", table 1: C_forward ≈ 2N; attention's 2·n_layer·n_ctx·d_attn left out),
training = 3 × forward (forward + backward: 6N).
"""

import argparse
import json
import os

CONFIGS = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(out):
    """The tests' tiny byte-level tokenizer (tests/src/tiny.rs `write_tokenizer`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tk.save(os.path.join(out, "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE, "add_bos_token": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


def roof(c):
    """Per-token GEMM weights, bytes and FLOPs (see the module docstring)."""
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    matmul = layers * per_layer + c["vocab_size"] * h
    return {
        "matmul_params": matmul,
        "bytes_per_token": 4 * matmul,
        "flops_per_token_forward": 2 * matmul,
        "flops_per_token_train": 6 * matmul,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(a.out, exist_ok=True)
    c = CONFIGS[a.config]
    torch.manual_seed(a.seed)
    cfg = AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"})
    cfg.architectures = c["architectures"]
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True)
    # The config as the published model ships it (newer transformers rewrite `rope_theta`
    # into `rope_parameters` on save).
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump({**c, "torch_dtype": "bfloat16"}, f, indent=1)
    write_tokenizer(a.out)
    r = roof(c)
    n = sum(p.numel() for p in model.parameters())
    r["parameters"] = n
    with open(os.path.join(a.out, "roof.json"), "w") as f:
        json.dump(r, f, indent=1)
    print(f"{a.out}: {a.config}, {n / 1e6:.1f}M parameters (bf16), GEMM weights {r['matmul_params'] / 1e6:.1f}M")


if __name__ == "__main__":
    main()
