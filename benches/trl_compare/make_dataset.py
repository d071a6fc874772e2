#!/usr/bin/env python3
"""Writes examples/add_0_9.jsonl: 512 chat prompts "What is {a} + {b}? Reply with only the
number." with a, b uniform in 0..9 (seeded) and `answer` = a + b: the TRL parity task."""
import json, os, random

rng = random.Random(0)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "add_0_9.jsonl")
with open(out, "w") as f:
    for _ in range(512):
        a, b = rng.randrange(10), rng.randrange(10)
        msg = {"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}
        f.write(json.dumps({"messages": [msg], "answer": a + b}) + "\n")
print(out)
