#!/usr/bin/env python3
"""Summary of benches/trl_compare/staleness.sh runs: staleness.py DIR [DIR ...] reads each
DIR/k<staleness>-s<seed>/metrics.jsonl and prints per staleness and seed the first step whose
rolling 10-step mean reward (over a full window) is >= 0.9, the mean reward of the last 20
steps and of the run, the median seconds per step (steps 5 on: the first steps pay warm-up),
whether the run collapsed (went past 0.9, then its last-20 mean fell below 0.5), and per
staleness the median first step (a run that never gets there counts as its length + 1), how
many seeds got there, whether that median is within 1.2x the on-policy one, and the s/step
ratio to staleness 0."""
import glob, json, os, re, statistics as st, sys

runs = {}
for d in sys.argv[1:]:
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
    return next((i + 1 for i in range(9, len(rw)) if st.mean(rw[i - 9:i + 1]) >= 0.9), None)


def step_seconds(rows):
    el = [x.get("elapsed_seconds") for x in rows]
    gaps = [b - a for a, b in zip(el[4:], el[5:]) if a is not None and b is not None]
    return st.median(gaps) if gaps else float("nan")


summary = {}
for k in sorted(runs):
    print(f"max_staleness {k}")
    fs, sps = [], []
    for s, rows in sorted(runs[k].items()):
        rw = [x["reward"] for x in rows]
        f = first(rw)
        collapsed = f is not None and st.mean(rw[-20:]) < 0.5
        fs.append(f if f is not None else len(rw) + 1)
        sps.append(step_seconds(rows))
        print(f"  seed {s}: first >= 0.9 at {str(f) if f else 'never':>5}  last20 {st.mean(rw[-20:]):.2f}  "
              f"mean {st.mean(rw):.2f}  s/step {sps[-1]:.2f}  clip {st.mean([x.get('clip_ratio', 0) for x in rows]):.4f}"
              f"{'  COLLAPSED' if collapsed else ''}")
    summary[k] = (st.median(fs), sum(1 for f in fs if f <= len(rw)), len(fs), st.median(sps))
base = summary.get(0)
for k, (med, ok, n, sp) in sorted(summary.items()):
    within = "" if base is None or k == 0 else f"  within 1.2x on-policy: {'yes' if med <= 1.2 * base[0] else 'no'}" \
        f" ({med / base[0]:.2f}x)  s/step {sp / base[3]:.2f}x on-policy"
    print(f"staleness {k}: median first {med}, reached on {ok}/{n} seeds, median s/step {sp:.2f}{within}")
