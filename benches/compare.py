#!/usr/bin/env python3
"""rlserve against its CPU peers, back to back, alternating, medians and ratios (stdlib only).

Run through benches/compare.sh, which builds rlserve and sets the peers up first
(benches/peers/setup.sh). Every measurement runs rlserve and each peer one after the other,
`--reps` times in alternation (rlserve, peer, rlserve, peer, ...), and the table gives the
median of each side and the ratio rlserve / peer (> 1: rlserve is faster; for s/step the
ratio is peer / rlserve, so > 1 still means rlserve is faster).

Work compared (the CPU-performance issue's table):
- train: one learner step, 8 × (128 + 128) tokens, forward + backward + AdamW (the median of
  `--train-steps` timed steps after a warm-up step, on both sides):
  `rlserve bench train` vs PyTorch with the transformers model class (`--hf`) and with
  benches/train_step_torch.py's functional model;
- train-rl: the same at the GRPO job's shape, 8 generations of one 30-token prompt, 16
  completion tokens each (rlserve runs the shared prompt's rows once; PyTorch all 8 copies);
- latency: prefill of 512 tokens and decode of 128 tokens, one sequence:
  `rlserve bench latency` vs `llama-bench` (F32 GGUF of the same weights);
- batched: 64 sequences, 64-token prompts, 32 output tokens; output tokens over the whole
  run (prefill included), and over the decode phase alone (llama's S_TG; rlserve's steps
  that computed no prompt token): `rlserve bench throughput` vs `llama-batched-bench`;
- serve: the same HTTP load (`rlserve bench serve`, 32 streaming completions, 64 + 32
  tokens, all at once) against `rlserve serve` and `llama-server`.
The machine must be idle: the script refuses to start when the 1-minute load average is
above --max-load (a peer timed on a loaded machine is not a comparison), and prints the
load average after every run.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, env=None, timeout=1800):
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    load = open("/proc/loadavg").read().split()[0]
    print(f"  {time.perf_counter() - t:6.1f} s  load {load}  {' '.join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))[:150]}", flush=True)
    return out.stdout + out.stderr


def grab(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        sys.exit(f"could not find {what} ({pattern!r}) in:\n{text[-3000:]}")
    return float(m.group(1))


class Shared:
    """One run that gives several figures (a `bench latency` run gives pp512 and tg128): each
    call of `get(key)` takes the oldest unused value of `key`, running again only when none is
    left, so the cases sharing the run see the same alternations without running twice."""

    def __init__(self, run):
        self.run, self.left = run, {}

    def get(self, key):
        if not self.left.get(key):
            for k, v in self.run().items():
                self.left.setdefault(k, []).append(v)
        return self.left[key].pop(0)


class Server:
    """A server process started for one measurement and stopped after it."""

    def __init__(self, cmd, port):
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/health"
        for _ in range(300):
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    return
            except OSError:
                pass
            if self.p.poll() is not None:
                sys.exit(f"server exited: {' '.join(cmd)}")
            time.sleep(0.5)
        sys.exit(f"server did not come up: {' '.join(cmd)}")

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rlserve", default=os.path.join(ROOT, "target/debug/rlserve"))
    ap.add_argument("--peers", default=os.path.join(ROOT, ".peers"), help="benches/peers/setup.sh's folder")
    ap.add_argument("--python", help="python with torch + transformers (default: PEERS/venv)")
    ap.add_argument("--model", default=os.path.join(os.environ.get("RLSERVE_MODELS_DIR", os.path.join(ROOT, "models")), "SmolLM2-135M-Instruct"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="train,train-rl,latency,batched,serve")
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--train-steps", type=int, default=3,
                    help="timed learner steps per run, after one warm-up step (both sides; the median is reported). "
                         "The first steps of either side fault their working set in, which is slow on some VMs; "
                         "more steps measure the steady state a training run sees")
    ap.add_argument("--port", type=int, default=8397)
    a = ap.parse_args()
    load = float(open("/proc/loadavg").read().split()[0])
    if load > a.max_load:
        sys.exit(f"load average {load} > --max-load {a.max_load}: stop builds, servers and helpers first (see `top`)")
    py = a.python or os.path.join(a.peers, "venv/bin/python")
    llama = os.path.join(a.peers, "llama/bin")
    gguf = os.path.join(a.peers, "SmolLM2-135M-Instruct-f32.gguf")
    rl = [a.rlserve, "--threads", str(a.threads)]
    t = str(a.threads)
    only = a.only.split(",")
    # name → (unit, higher is better, [(label, command, parse)]) ; the first entry is rlserve.
    cases = []

    def train(name, n, p, c, g):
        sec = r"([\d.]+) s/step"
        torch_cmd = [py, "benches/train_step_torch.py", a.model, "--threads", t, "--num-seqs", str(n),
                     "--prompt-len", str(p), "--completion-len", str(c), "--steps", str(a.train_steps)]
        what = f"learner step {n} × ({p} + {c}) tokens" + (f", {g} per prompt (rlserve shares it)" if g > 1 else "")
        cases.append((name, what, "s/step", False, [
            ("rlserve", lambda: grab(sec, run(rl + ["bench", "train", "--model", a.model, "--num-seqs", str(n), "--prompt-len", str(p), "--completion-len", str(c), "--num-generations", str(g), "--steps", str(a.train_steps)]), "s/step")),
            ("PyTorch + transformers (HF class)", lambda: grab(sec, run(torch_cmd + ["--hf"]), "s/step")),
            ("PyTorch (functional model)", lambda: grab(sec, run(torch_cmd), "s/step")),
        ]))

    if "train" in only:
        train("train", 8, 128, 128, 1)
    if "train-rl" in only:
        train("train-rl", 8, 30, 16, 8)
    if "latency" in only:
        def rl_lat():
            out = run(rl + ["bench", "latency", "--model", a.model, "--prompt-tokens", "512", "--gen-tokens", "128", "--repetitions", "3"])
            return dict(pp512=grab(r"\| pp512 \| ([\d.]+)", out, "pp512"), tg128=grab(r"\| tg128 \| ([\d.]+)", out, "tg128"))

        def llama_lat():
            out = run([os.path.join(llama, "llama-bench"), "-m", gguf, "-t", t, "-p", "512", "-n", "128", "-r", "3"])
            return dict(pp512=grab(r"pp512 \|\s+([\d.]+)", out, "pp512"), tg128=grab(r"tg128 \|\s+([\d.]+)", out, "tg128"))

        ours, theirs = Shared(rl_lat), Shared(llama_lat)
        for test, what in [("pp512", "prefill, 512 tokens"), ("tg128", "decode, 1 sequence, 128 tokens")]:
            cases.append((test, what, "tok/s", True, [
                ("rlserve", lambda test=test, s=ours: s.get(test)),
                ("llama.cpp llama-bench F32", lambda test=test, s=theirs: s.get(test)),
            ]))
    if "batched" in only:
        def rl_batched():
            out = run(rl + ["bench", "throughput", "--model", a.model, "--num-prompts", "64", "--input-len", "64", "--output-len", "32", "--no-curve"])
            return dict(run=grab(r"([\d.]+) output tokens/s", out, "output tokens/s"),
                        tg=grab(r"Decode phase: ([\d.]+) output tokens/s", out, "decode phase"))

        def llama_batched():
            out = run([os.path.join(llama, "llama-batched-bench"), "-m", gguf, "-t", t, "-tb", t, "-c", "8192", "-b", "2048", "-ub", "512",
                       "-npp", "64", "-ntg", "32", "-npl", "64"])
            # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
            row = re.search(r"^\|\s*64\s*\|\s*32\s*\|\s*64\s*\|.*$", out, re.M)
            if not row:
                sys.exit(f"no 64/32/64 row in llama-batched-bench output:\n{out[-3000:]}")
            cells = [x.strip() for x in row.group(0).strip("|").split("|")]
            # Output tokens over the whole run (prefill included), and S_TG: the decode phase.
            return dict(run=64 * 32 / float(cells[8]), tg=float(cells[7]))

        ours, theirs = Shared(rl_batched), Shared(llama_batched)
        for key, what in [("run", "batched generation, 64 seqs × (64 + 32) tokens, output tok/s over the whole run"),
                          ("tg", "batched decode, 64 seqs (decode phase: llama's S_TG, rlserve's steps without prefill), output tok/s")]:
            cases.append(("batched" if key == "run" else "batched-tg", what, "tok/s", True, [
                ("rlserve", lambda key=key, s=ours: s.get(key)),
                ("llama.cpp llama-batched-bench F32", lambda key=key, s=theirs: s.get(key)),
            ]))
    if "serve" in only:
        def serve(cmd):
            s = Server(cmd, a.port)
            try:
                out = run(rl + ["bench", "serve", "--base-url", f"http://127.0.0.1:{a.port}", "--num-prompts", "32", "--input-len", "64", "--output-len", "32"])
            finally:
                s.stop()
            if grab(r"Failed requests:\s+(\d+)", out, "failed requests") > 0:
                sys.exit(f"requests failed:\n{out}")
            return grab(r"Output token throughput \(tok/s\):\s+([\d.]+)", out, "output throughput")

        cases.append(("serve", "HTTP serving, 32 streaming completions × (64 + 32) tokens, output tok/s", "tok/s", True, [
            # The same KV pool as llama-server's `-c 4096` (256 blocks of 16), written at start
            # as llama.cpp clears its own.
            ("rlserve serve", lambda: serve(rl + ["serve", "--model", a.model, "--port", str(a.port), "--num-blocks", "256", "--kv-cache-prefault"])),
            ("llama-server F32", lambda: serve([os.path.join(llama, "llama-server"), "-m", gguf, "-t", t, "-tb", t, "--port", str(a.port), "-np", "32", "-c", str(32 * 128), "-cb"])),
        ]))

    results = {}
    for name, what, unit, higher, sides in cases:
        print(f"== {name}: {what}", flush=True)
        vals = {label: [] for label, _ in sides}
        for _ in range(a.reps):
            for label, f in sides:
                vals[label].append(f())
        results[name] = (what, unit, higher, vals)

    print(f"\n{a.reps} alternations, medians; ratio > 1 means rlserve is faster; {a.threads} threads, {os.cpu_count()} cores")
    print(f"machine: {machine()}")
    print("| work | unit | rlserve | peer | peer value | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (what, unit, higher, vals) in results.items():
        labels = list(vals)
        ours = statistics.median(vals[labels[0]])
        for peer in labels[1:]:
            theirs = statistics.median(vals[peer])
            ratio = ours / theirs if higher else theirs / ours
            print(f"| {what} | {unit} | {ours:.2f} | {peer} | {theirs:.2f} | **{ratio:.2f}×** |")
    print("\nall values:")
    for name, (_, unit, _, vals) in results.items():
        for label, v in vals.items():
            print(f"  {name:9} {label:36} {unit:6} {', '.join(f'{x:.2f}' for x in v)}")


def machine():
    """The CPU (model name, family/model), its L2 per core and the transparent-huge-page mode:
    what the figures depend on, since a VM's host can change between sessions."""
    def read(path):
        try:
            with open(path) as fh:
                return fh.read()
        except OSError:
            return ""
    info = {}
    for line in read("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    l2 = read("/sys/devices/system/cpu/cpu0/cache/index2/size").strip() or "?"
    thp = read("/sys/kernel/mm/transparent_hugepage/enabled").strip() or "?"
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}), "
            f"L2 {l2} per core, THP {thp}")


if __name__ == "__main__":
    main()
