#!/usr/bin/env python3
"""The official Tinker SDK (`tinker` 0.38.0 from PyPI, unchanged) drives `rlserve serve`'s
Tinker API: a supervised step and an RL step on the served weights, each built-in loss, a
sampling client, save_state/load_state, and errors. Run by .ci/run against a server started
with --checkpoint-dir:
    tinker_client.py http://127.0.0.1:PORT
Every check compares with an independent value: the loss against the formula recomputed here
from the returned per-token logprobs and the inputs (Tinker docs, "Losses"), the learner's
logprobs against the engine's (sampling and prompt logprobs), the weights after load_state
against those at save_state."""
import math
import os
import sys

os.environ.setdefault("TINKER_API_KEY", "tml-rlserve")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

base_url = sys.argv[1]
service = tinker.ServiceClient(base_url=base_url)
# The cookbook's first call: the one model the server trains, the one it serves.
models = [m.model_name for m in service.get_server_capabilities().supported_models]
assert len(models) == 1, models
print("supported models", models)
# The server trains the model it serves; its folder names it (get_info's model_name).
training = service.create_lora_training_client(base_model=sys.argv[2], rank=8).result()
tokenizer = training.get_tokenizer()
info = training.get_info()
print("model", info.model_data.model_name, "arch", info.model_data.arch)


def datum(tokens, **inputs):
    """A next-token datum: input tokens[:-1], targets tokens[1:], per-target inputs."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def close(a, b, tol, what):
    assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what}: {a} vs {b}"


# 1. Supervised: cross_entropy's loss:sum is −Σ w·ℓ of the returned logprobs; five steps on
# one example lower it.
text = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
weights = [0.0] * 4 + [1.0] * (len(text) - 5)
sft = datum(text, weights=weights)
losses = []
for step in range(5):
    out = training.forward_backward([sft], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(lp) == len(text) - 1, (len(lp), len(text))
    close(out.metrics["loss:sum"], -sum(w * x for w, x in zip(weights, lp)), 1e-4, "cross_entropy loss:sum")
    losses.append(out.metrics["loss:sum"])
    m = training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    print("sft step", step, "loss", round(losses[-1], 4), "optim", m.metrics)
assert losses[-1] < 0.8 * losses[0], f"five AdamW steps did not lower the loss: {losses}"

# 2. forward leaves the weights as they are.
a = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
b = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
assert a == b, "forward changed the weights"

# 3. The engine's prompt logprobs of the same tokens (compute_logprobs, another code path)
# equal the learner's.
sampler = training.save_weights_and_get_sampling_client().result()
engine_lp = sampler.compute_logprobs(types.ModelInput.from_ints(text)).result()
assert engine_lp[0] is None or math.isnan(engine_lp[0])
for i, (x, y) in enumerate(zip(engine_lp[1:], a)):
    close(x, y, 1e-3, f"prompt logprob {i + 1}")

# 4. RL: sample with logprobs; the learner's logprobs of the sampled tokens equal the
# sampler's (same weights, temperature 1); each policy loss matches its formula.
prompt = tokenizer.encode("Question: what is 2 + 3? Answer:")
res = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                     types.SamplingParams(max_tokens=12, temperature=1.0, seed=7)).result()
assert len(res.sequences) == 4
rl_data, q_all, adv_all = [], [], []
for k, s in enumerate(res.sequences):
    assert s.logprobs is not None and len(s.logprobs) == len(s.tokens) > 0
    assert s.stop_reason in ("stop", "length")
    toks = prompt + list(s.tokens)
    n_prompt = len(prompt) - 1
    q = [0.0] * n_prompt + list(s.logprobs)
    adv = [0.0] * n_prompt + [1.0 if k % 2 == 0 else -1.0] * len(s.tokens)
    rl_data.append(datum(toks, logprobs=q, advantages=adv))
    q_all.append(q)
    adv_all.append(adv)
configs = [
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("dro", {"beta": 0.05}),
]
for loss_fn, config in configs:
    out = training.forward_backward(rl_data, loss_fn, config).result()
    want = 0.0
    for rec, q, adv, s in zip(out.loss_fn_outputs, q_all, adv_all, res.sequences):
        lp = rec["logprobs"].tolist()
        n_prompt = len(lp) - len(s.tokens)
        for t in range(n_prompt, len(lp)):
            close(lp[t], q[t], 2e-3, f"{loss_fn}: learner vs sampler logprob")
        for l, qq, A in zip(lp, q, adv):
            r = math.exp(l - qq)
            if loss_fn == "importance_sampling":
                want -= r * A
            elif loss_fn == "ppo":
                want -= min(r * A, min(max(r, 0.9), 1.1) * A)
            elif loss_fn == "cispo":
                want -= min(max(r, 0.8), 1.2) * l * A
            else:
                want -= l * A - 0.5 * 0.05 * (l - qq) ** 2
    close(out.metrics["loss:sum"], want, 1e-3, f"{loss_fn} loss:sum")
    print(loss_fn, "loss:sum", round(out.metrics["loss:sum"], 4))
print("rl optim", training.optim_step(types.AdamParams(learning_rate=1e-5, grad_clip_norm=1.0)).result().metrics)

# 5. save_state / load_state: the weights come back.
saved = training.save_state("ci-state").result()
before = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
training.forward_backward([sft], "cross_entropy").result()
training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
moved = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
assert moved != before
# A training client from the saved state (with its AdamW moments) replaces this one.
training = service.create_training_client_from_state_with_optimizer(saved.path).result()
after = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
assert after == before, "load_state did not restore the weights"

# 6. Errors reach the client with their reason.
for loss_fn, want in [("stable_reinforce", "not supported"), ("kl", "unknown loss_fn")]:
    try:
        training.forward_backward([sft], loss_fn).result()
        raise AssertionError(f"{loss_fn} was accepted")
    except tinker.RequestFailedError as e:
        assert want in str(e), str(e)
try:
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": [5, 5, 5], "weights": [1.0, 1.0, 1.0]})
    training.forward_backward([bad], "cross_entropy").result()
    raise AssertionError("misaligned targets were accepted")
except tinker.RequestFailedError as e:
    assert "shifted by one" in str(e), str(e)
try:
    training.load_state("tinker://elsewhere/weights/never-saved").result()
    raise AssertionError("a missing checkpoint loaded")
except tinker.RequestFailedError as e:
    assert "no checkpoint named `never-saved`" in str(e), str(e)
# A NaN loss input is refused; an overflowing importance ratio (a -1e4 sampler logprob as a
# mask, times a zero advantage: inf * 0) makes the gradient NaN, and optim_step refuses it
# without touching the served weights.
try:
    training.forward_backward([datum(text, weights=[float("nan")] * (len(text) - 1))], "cross_entropy").result()
    raise AssertionError("a NaN weight was accepted")
except tinker.RequestFailedError as e:
    assert "is not a finite number" in str(e), str(e)
before = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
n = len(text) - 1
masked = datum(text, logprobs=[-1e4] * n, advantages=[0.0] * (n - 1) + [1.0])
training.forward_backward([masked], "importance_sampling").result()
try:
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    raise AssertionError("a NaN gradient was applied")
except tinker.RequestFailedError as e:
    assert "the gradient is not finite" in str(e), str(e)
after = training.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
assert after == before, "a refused optim_step changed the weights"
training.forward_backward([sft], "cross_entropy").result()
training.optim_step(types.AdamParams(learning_rate=1e-4)).result()

service.close("success") if hasattr(service, "close") else None
print("tinker SDK check passed")
