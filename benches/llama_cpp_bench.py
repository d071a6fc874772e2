#!/usr/bin/env python3
"""llama.cpp prefill/decode tokens/s on the default model's weights in F32, through
llama-cpp-python (used when llama-bench is not installed). Prints llama-bench's table rows.

usage: llama_cpp_bench.py F32_GGUF [--threads 2] [--prompt-tokens 512] [--gen-tokens 128] [--repetitions 3]
"""
import argparse, statistics, time
import llama_cpp

ap = argparse.ArgumentParser()
ap.add_argument("gguf")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompt-tokens", type=int, default=512)
ap.add_argument("--gen-tokens", type=int, default=128)
ap.add_argument("--repetitions", type=int, default=3)
a = ap.parse_args()
llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=a.prompt_tokens + a.gen_tokens + 8, n_batch=a.prompt_tokens,
                      n_ubatch=a.prompt_tokens, n_threads=a.threads, n_threads_batch=a.threads, type_k=0, type_v=0,
                      flash_attn=False, verbose=False)
vocab = llm.n_vocab()
prompt = [100 + (i * 2654435761) % (vocab - 100) for i in range(a.prompt_tokens)]
pp, tg = [], []
for _ in range(a.repetitions):
    llm.reset()
    t = time.perf_counter(); llm.eval(prompt); pp.append(a.prompt_tokens / (time.perf_counter() - t))
    llm.reset()
    llm.eval(prompt[:1])
    t = time.perf_counter()
    for i in range(a.gen_tokens - 1):
        llm.eval([100 + (i * 7919) % (vocab - 100)])
    tg.append((a.gen_tokens - 1) / (time.perf_counter() - t))
print(f"| llama.cpp f32 (llama-cpp-python {llama_cpp.__version__}) | {a.threads} | pp{a.prompt_tokens} | {statistics.median(pp):.1f} |")
print(f"| llama.cpp f32 (llama-cpp-python {llama_cpp.__version__}) | {a.threads} | tg{a.gen_tokens} | {statistics.median(tg):.1f} |")
