#!/usr/bin/env python3
"""The TRL side of the parity comparison: GRPOTrainer on the default model folder with the
settings of examples/trl_parity.toml; one JSON line per step (reward, entropy, length,
seconds) to --out.

    python trl_grpo.py --model models/SmolLM2-135M-Instruct --out runs/trl.jsonl --seed 0
"""
import argparse, json, re, time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", default="examples/add_0_9.jsonl")
p.add_argument("--out", required=True)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--steps", type=int, default=80)
a = p.parse_args()
torch.set_num_threads(2)

rows = [json.loads(l) for l in open(a.data)]
ds = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
NUM = re.compile(r"-?\d[\d,]*(\.\d+)?")


def first_number(completions, answer, **_):
    out = []
    for c, want in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        m = NUM.search(text)
        out.append(1.0 if m and float(m.group(0).rstrip(",").replace(",", "")) == float(want) else 0.0)
    return out


class Log(TrainerCallback):
    def __init__(self):
        self.f, self.t = open(a.out, "w"), time.time()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            now = time.time()
            rec = {"step": state.global_step, "reward": logs["reward"], "entropy": logs.get("entropy"),
                   "completion_length": logs.get("completions/mean_length"), "seconds": now - self.t}
            self.t = now
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()


cfg = GRPOConfig(
    output_dir="/tmp/trl-parity", per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8,
    max_completion_length=16, temperature=1.0, loss_type="dapo", beta=0.0, learning_rate=3e-5, max_grad_norm=1.0,
    max_steps=a.steps, logging_steps=1, seed=a.seed, bf16=False, gradient_checkpointing=False, report_to=[],
    save_strategy="no", use_cpu=True, dataloader_num_workers=0,
)
model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(a.model)
GRPOTrainer(model=model, processing_class=tok, reward_funcs=first_number, args=cfg, train_dataset=ds,
            callbacks=[Log()]).train()
