#!/usr/bin/env python3
"""Writes the preference pairs of examples/dpo.toml (deterministic; no dependencies).

    python3 examples/make_dpo_pairs.py

Each line: the arithmetic task's prompt ("What is a + b? ..."), the correct answer
("#### a+b") chosen over a wrong one ("#### a+b+d", d in ±1, ±2, ±3, +10). The pairs
(a, b) split as in rlserve's `builtin:arithmetic`: those with (7a + b) % 5 == 0 are held out
(examples/dpo_pairs_eval.jsonl), the others train (examples/dpo_pairs.jsonl).
"""
import json, os, random

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(0)
train, held_out = [], []
for a in range(20):
    for b in range(10):
        prompt = f"What is {a} + {b}? Give only the final answer after ####, like this: #### 42"
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3, 10])
        if wrong < 0:
            wrong = a + b + 10
        line = {"prompt": prompt, "chosen": f"#### {a + b}", "rejected": f"#### {wrong}"}
        (held_out if (7 * a + b) % 5 == 0 else train).append(line)
for name, rows in [("dpo_pairs.jsonl", train), ("dpo_pairs_eval.jsonl", held_out)]:
    with open(os.path.join(HERE, name), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(name, len(rows))
