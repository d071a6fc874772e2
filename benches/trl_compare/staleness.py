#!/usr/bin/env python3
"""Summary of benches/trl_compare/staleness.sh runs: staleness.py DIR [DIR ...] reads each
DIR/k<staleness>-s<seed>/metrics.jsonl and prints per staleness and seed the first step whose
rolling 10-step mean reward (over a full window) is >= 0.9, the mean reward of the last 20
steps and of the run, the median seconds per step (steps 5 on: the first steps pay warm-up),
whether the run collapsed (went past 0.9, then its last-20 mean fell below 0.5), and per
staleness the median first step (a run that never gets there counts as its length + 1), how
many seeds got there, the mean reward over all its runs (and over their last 20 steps),
whether that median is within 1.2x the on-policy one (with a seed-bootstrap interval of the
ratio: what the seed-to-seed spread alone allows), the s/step ratio to staleness 0, and the
run mean reward's difference from on-policy paired by seed, with its bootstrap interval.
Runs of several DIRs pool by staleness (a seed in two DIRs counts once, the last DIR's).
`--threshold X` replaces 0.9 (a task whose prompts differ in difficulty may hold its rolling
mean below 0.9 for most of a run)."""
import glob, json, os, random, re, statistics as st, sys

args = sys.argv[1:]
THRESHOLD = 0.9
if "--threshold" in args:
    i = args.index("--threshold")
    THRESHOLD = float(args[i + 1])
    del args[i:i + 2]

runs = {}
for d in args:
    for r in glob.glob(os.path.join(d, "k*-s*")):
        m = re.search(r"k(\d+)-s(\d+)$", r)
        path = os.path.join(r, "metrics.jsonl")
        if not m or not os.path.exists(path):
            continue
        rows = [json.loads(l) for l in open(path)]
        rows = [x for x in rows if "reward" in x and x.get("kind", "train") == "train"]
        if rows:
            runs.setdefault(int(m[1]), {})[int(m[2])] = rows


def first(rw):
    return next((i + 1 for i in range(9, len(rw)) if st.mean(rw[i - 9:i + 1]) >= THRESHOLD), None)


def step_seconds(rows):
    el = [x.get("elapsed_seconds") for x in rows]
    gaps = [b - a for a, b in zip(el[4:], el[5:]) if a is not None and b is not None]
    return st.median(gaps) if gaps else float("nan")


summary, firsts = {}, {}
for k in sorted(runs):
    print(f"max_staleness {k}")
    fs, sps = [], []
    for s, rows in sorted(runs[k].items()):
        rw = [x["reward"] for x in rows]
        f = first(rw)
        collapsed = f is not None and st.mean(rw[-20:]) < 0.5
        fs.append(f if f is not None else len(rw) + 1)
        sps.append(step_seconds(rows))
        print(f"  seed {s}: first >= {THRESHOLD} at {str(f) if f else 'never':>5}  last20 {st.mean(rw[-20:]):.2f}  "
              f"mean {st.mean(rw):.2f}  s/step {sps[-1]:.2f}  clip {st.mean([x.get('clip_ratio', 0) for x in rows]):.4f}"
              f"{'  COLLAPSED' if collapsed else ''}")
    firsts[k] = fs
    rewards = [[x["reward"] for x in rows] for rows in runs[k].values()]
    summary[k] = (st.median(fs), sum(1 for f in fs if f <= len(rw)), len(fs), st.median(sps),
                  st.mean(st.mean(r) for r in rewards), st.mean(st.mean(r[-20:]) for r in rewards))


def median_ratio_interval(a, b, n=10000):
    """A 95% percentile-bootstrap interval of median(a) / median(b), seeds resampled
    (Efron & Tibshirani 1993, ch. 13): how far the seed-to-seed spread alone moves the ratio."""
    rng = random.Random(0)
    rs = sorted(st.median(rng.choices(a, k=len(a))) / st.median(rng.choices(b, k=len(b))) for _ in range(n))
    return rs[int(0.025 * n)], rs[int(0.975 * n)]


def paired_difference(k, n=10000):
    """Mean over the seeds run at both staleness k and 0 of (run mean reward at k − at 0), with
    its 95% percentile-bootstrap interval over seeds. A seed fixes the prompt order, which
    decides most of a run's outcome at every staleness, so the paired difference is far
    tighter than a comparison of medians."""
    seeds = sorted(set(runs[k]) & set(runs[0]))
    mean = lambda s, x: st.mean(r["reward"] for r in runs[x][s])
    d = [mean(s, k) - mean(s, 0) for s in seeds]
    rng = random.Random(0)
    bs = sorted(st.mean(rng.choices(d, k=len(d))) for _ in range(n))
    return st.mean(d), bs[int(0.025 * n)], bs[int(0.975 * n)], len(d)


base = summary.get(0)
for k, (med, ok, n, sp, mean, last20) in sorted(summary.items()):
    within = ""
    if base is not None and k != 0:
        lo, hi = median_ratio_interval(firsts[k], firsts[0])
        within = f"  within 1.2x on-policy: {'yes' if med <= 1.2 * base[0] else 'no'} ({med / base[0]:.2f}x, " \
            f"seed-bootstrap 95% {lo:.2f}-{hi:.2f}x)  s/step {sp / base[3]:.2f}x on-policy"
        d, dlo, dhi, nd = paired_difference(k)
        within += f"  run mean reward minus on-policy's, paired by seed: {d:+.3f} (95% {dlo:+.3f} to {dhi:+.3f}, {nd} seeds)"
    print(f"staleness {k}: median first {med}, reached on {ok}/{n} seeds, mean reward {mean:.2f} (last 20: {last20:.2f}), "
          f"median s/step {sp:.2f}{within}")
