#!/usr/bin/env python3
"""Summary of benches/trl_compare/staleness.sh runs: staleness.py DIR [DIR ...] reads each
DIR/k<staleness>-s<seed>/metrics.jsonl and prints per staleness and seed the first step whose
rolling 10-step mean reward (over a full window) is >= 0.9, the mean reward of the last 20
steps and of the run, the median seconds per step (steps 5 on: the first steps pay warm-up),
the trained batches' staleness (mean over the steps after the on-policy warm start, and max),
whether the run collapsed (went past 0.9, then its last-20 mean fell below 0.5), and per
staleness the median first step (a run that never gets there counts as its length + 1), how
many seeds got there, the mean reward over all its runs (and over their last 20 steps), how
many runs collapsed, whether that median is within 1.2x the on-policy one (with a
seed-bootstrap interval of the ratio: what the seed-to-seed spread alone allows), the s/step
ratio to staleness 0, the run mean reward's difference from on-policy paired by seed, with its
bootstrap interval, and with 10 or more seeds the issue's 5-seed criterion applied to each
block of 5 seeds, and per phase of the run the entropy and the fraction of all-equal-reward
groups against on-policy. Runs of several DIRs pool by staleness (a seed in two DIRs counts
once, the last DIR's; with `--repeats` every run counts, a seed by the mean over its runs;
then it also prints how often the 5-seed criterion holds with one run per seed drawn at random
from each side, for each staleness against on-policy and for on-policy against its own
repeats: the criterion's noise floor, per seed whether its first step at each staleness is
within 1.2x of its on-policy one, and runs paired run by run: the run mean reward's
difference, and the runs that never learned, with McNemar's exact test).
`--seeds 0,1,2,3,4` keeps only those seeds. `--threshold X` replaces 0.9 (a task whose prompts
differ in difficulty may hold its rolling mean below 0.9 for most of a run)."""
import argparse, glob, json, math, os, random, re, statistics as st

parser = argparse.ArgumentParser(description="Summary of benches/trl_compare/staleness.sh runs.")
parser.add_argument("dirs", nargs="+", metavar="DIR")
parser.add_argument("--threshold", type=float, default=0.9)
parser.add_argument("--seeds", type=lambda v: {int(x) for x in v.split(",")},
                    help="only these seeds (comma-separated), e.g. 0,1,2,3,4")
parser.add_argument("--repeats", action="store_true",
                    help="a seed run in several DIRs counts with the mean over its runs (first step, rewards)")
args = parser.parse_args()
THRESHOLD = args.threshold

runs = {}
for d in args.dirs:
    for r in glob.glob(os.path.join(d, "k*-s*")):
        m = re.search(r"k(\d+)-s(\d+)$", r)
        path = os.path.join(r, "metrics.jsonl")
        if not m or not os.path.exists(path) or (args.seeds and int(m[2]) not in args.seeds):
            continue
        rows = [json.loads(l) for l in open(path)]
        rows = [x for x in rows if "reward" in x and x.get("kind", "train") == "train"]
        if rows:
            reps = runs.setdefault(int(m[1]), {}).setdefault(int(m[2]), [])
            if not args.repeats:
                reps.clear()
            reps.append((d, rows))


def first(rw):
    return next((i + 1 for i in range(9, len(rw)) if st.mean(rw[i - 9:i + 1]) >= THRESHOLD), None)


def step_seconds(rows):
    el = [x.get("elapsed_seconds") for x in rows]
    gaps = [b - a for a, b in zip(el[4:], el[5:]) if a is not None and b is not None]
    return st.median(gaps) if gaps else float("nan")


def bootstrap_interval(draw, n=10000):
    """The 95% percentile-bootstrap interval (Efron & Tibshirani 1993, ch. 13) of the statistic
    `draw(resample)` computes on seeds resampled with replacement (`resample(xs)`)."""
    rng = random.Random(0)
    vals = sorted(draw(lambda xs: rng.choices(xs, k=len(xs))) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n)]


summary, firsts, run_means, reached_by, run_firsts = {}, {}, {}, {}, {}
for k in sorted(runs):
    print(f"max_staleness {k}")
    fs, sps, last20s, collapses = [], [], [], 0
    run_means[k], reached_by[k], run_firsts[k] = {}, {}, {}
    for s, reps in sorted(runs[k].items()):
        sf, sm, sl = [], [], []
        for d, rows in reps:
            rw = [x["reward"] for x in rows]
            f = first(rw)
            collapsed = f is not None and st.mean(rw[-20:]) < 0.5
            collapses += collapsed
            sf.append(f if f is not None else len(rw) + 1)
            reached_by[k][s] = reached_by[k].get(s, 0) + (f is not None) / len(reps)
            sps.append(step_seconds(rows))
            sm.append(st.mean(rw))
            sl.append(st.mean(rw[-20:]))
            # The staleness of the trained tokens (generate_ahead = "as_needed" runs ahead of the
            # learner only where generation is the slower side, so it may stay below the bound).
            stale = [x.get("staleness_mean", 0) for x in rows]
            after = stale[next((i for i, v in enumerate(stale) if v > 0), len(stale)):] or [0]
            print(f"  seed {s}{f' ({d})' if args.repeats else ''}: first >= {THRESHOLD} at {str(f) if f else 'never':>5}  "
                  f"last20 {sl[-1]:.2f}  mean {sm[-1]:.2f}  s/step {sps[-1]:.2f}  "
                  f"clip {st.mean([x.get('clip_ratio', 0) for x in rows]):.4f}  "
                  f"staleness {st.mean(after):.2f} (max {max(x.get('staleness_max', 0) for x in rows)})"
                  f"{'  COLLAPSED' if collapsed else ''}")
        # Async runs are not repeatable (where an update lands depends on timing): the mean of
        # a seed's runs averages that noise out.
        fs.append(st.mean(sf))
        run_firsts[k][s] = [(f, f <= len(rows)) for f, (_, rows) in zip(sf, reps)]
        run_means[k][s] = st.mean(sm)
        last20s.append(st.mean(sl))
    firsts[k] = dict(zip(sorted(runs[k]), fs))
    summary[k] = (st.median(fs), round(sum(reached_by[k].values()), 1), len(fs), st.median(sps),
                  st.mean(run_means[k].values()), st.mean(last20s), (collapses, len(sps)))

base = summary.get(0)
for k, (med, ok, n, sp, mean, last20, (collapsed, n_runs)) in sorted(summary.items()):
    within = ""
    if base is not None and k != 0:
        # How far the seed-to-seed spread alone moves the ratio of medians: seeds resampled
        # together for both staleness values (a seed's prompt order decides much of both runs).
        both = sorted(set(firsts[k]) & set(firsts[0]))
        ratio = lambda ss: st.median(firsts[k][s] for s in ss) / st.median(firsts[0][s] for s in ss)
        lo, hi = bootstrap_interval(lambda re: ratio(re(both)))
        within = f"  within 1.2x on-policy: {'yes' if med <= 1.2 * base[0] else 'no'} ({med / base[0]:.2f}x, " \
            f"seed-bootstrap 95% {lo:.2f}-{hi:.2f}x)  s/step {sp / base[3]:.2f}x on-policy"
        if len(both) >= 10:
            # The criterion on each block of 5 seeds (in seed order): the ratio of the
            # block's medians within 1.2x and at least 4 of its 5 seeds reaching the threshold.
            blocks = [both[i:i + 5] for i in range(0, len(both) - 4, 5)]
            held = [ratio(b) <= 1.2 and sum(reached_by[k][s] for s in b) >= 4 for b in blocks]
            within += f"  5-seed blocks: {' '.join(f'{ratio(b):.2f}x' for b in blocks)} " \
                f"(criterion held on {sum(held)}/{len(blocks)})"
        # Paired by seed: a seed fixes the prompt order, which decides most of a run at every
        # staleness, so the difference of a seed's two runs is far tighter than medians.
        d = [run_means[k][s] - run_means[0][s] for s in sorted(set(run_means[k]) & set(run_means[0]))]
        dlo, dhi = bootstrap_interval(lambda re: st.mean(re(d)))
        within += f"  run mean reward minus on-policy's, paired by seed: {st.mean(d):+.3f} " \
            f"(95% {dlo:+.3f} to {dhi:+.3f}, {len(d)} seeds)"
    print(f"staleness {k}: median first {med:g}, reached on {ok:g}/{n} seeds, mean reward {mean:.2f} (last 20: {last20:.2f}), "
          f"median s/step {sp:.2f}, collapsed {collapsed} of {n_runs} runs{within}")

# Whether staleness changes how the policy sharpens, not only when it reaches the threshold:
# per phase of the run (after the warm start), the mean entropy of the sampled tokens and the
# fraction of groups whose rewards are all equal (no GRPO signal), minus the on-policy run's
# of the same seed; mean over seeds (a systematic shift would show across phases and k).
if base is not None:
    phases = [(10, 30), (30, 55), (55, None)]
    for key in ["entropy", "frac_reward_zero_std"]:
        for k in sorted(runs):
            if k == 0:
                continue
            both = sorted(set(runs[k]) & set(runs[0]))
            cells = []
            for lo, hi in phases:
                at = lambda k, s: st.mean(st.mean(x.get(key, 0) for x in rows[lo:hi]) for _, rows in runs[k][s])
                d = [at(k, s) - at(0, s) for s in both if all(len(r) > lo for _, r in runs[k][s] + runs[0][s])]
                if d:
                    cells.append(f"steps {lo + 1}-{hi or 'end'} {st.mean(d):+.3f} (sd {st.pstdev(d):.3f})")
            print(f"{key} at staleness {k} minus on-policy, paired by seed ({len(both)} seeds): {'  '.join(cells)}")

# With several runs per seed (--repeats; on-policy runs differ only with other sampling seeds,
# staleness.sh SAMPLE_SEED_OFFSET), per staleness:
# - the criterion's own noise floor: how often the 5-seed criterion holds when each
#   seed contributes one run drawn at random from each side, for staleness k against
#   on-policy and for on-policy against another of its own runs;
# - the criterion read per seed: a seed's first step at k within 1.2x of its own on-policy
#   first step, a seed's runs summed up by their mean and by their median (a run that never
#   gets there counts as its length + 1, so with few runs a median is often that);
# - runs paired run by run (same DIR and seed: the same prompts and sampling seeds, and the
#   same warm start): the run mean reward's difference, and how many runs never learned
#   (run mean reward < 0.3), with the pairs where only one side did (McNemar's exact test).
if base is not None and args.repeats:
    rng = random.Random(0)
    for k in sorted(runs):
        what = "on-policy against another on-policy run" if k == 0 else f"staleness {k} against on-policy"
        both = sorted(set(run_firsts[k]) & set(run_firsts[0]))
        floor = [s for s in both if len(run_firsts[0][s]) >= 2] if k == 0 else both
        cells = []
        for b in [floor[i:i + 5] for i in range(0, len(floor) - 4, 5)]:
            held, n = 0, 4000
            for _ in range(n):
                pairs = [rng.sample(run_firsts[0][s], 2) if k == 0 else
                         (rng.choice(run_firsts[k][s]), rng.choice(run_firsts[0][s])) for s in b]
                ratio = st.median(p[0][0] for p in pairs) / st.median(p[1][0] for p in pairs)
                held += ratio <= 1.2 and sum(p[0][1] for p in pairs) >= 4
            runs_per_seed = "/".join(str(len(run_firsts[k][s])) for s in b)
            cells.append(f"seeds {b[0]}-{b[-1]} ({runs_per_seed} runs): {held / n:.2f}")
        if cells:
            print(f"5-seed criterion held, one random run per seed, {what}: {'  '.join(cells)}")
        if k == 0 or not both:
            continue
        cells = []
        for name, agg in [("mean", st.mean), ("median", st.median)]:
            r = [agg(f for f, _ in run_firsts[k][s]) / agg(f for f, _ in run_firsts[0][s]) for s in both]
            cells.append(f"{name} of runs {sum(x <= 1.2 for x in r)}/{len(r)} "
                         f"({' '.join(f'{x:.2f}' for x in r)})")
        print(f"per seed, first step at staleness {k} within 1.2x of on-policy's: {'  '.join(cells)}")
        mean_of = lambda rows: st.mean(x["reward"] for x in rows)
        on = {(d, s): mean_of(rows) for s in both for d, rows in runs[0][s]}
        pairs = [(mean_of(rows), on[d, s]) for s in both for d, rows in runs[k][s] if (d, s) in on]
        d = [x - y for x, y in pairs]
        dlo, dhi = bootstrap_interval(lambda re: st.mean(re(d)))
        only_on = sum(y >= 0.3 > x for x, y in pairs)
        only_k = sum(x >= 0.3 > y for x, y in pairs)
        m = only_on + only_k
        p_value = min(1.0, 2 * sum(math.comb(m, i) for i in range(min(only_on, only_k) + 1)) / 2 ** m) if m else 1.0
        print(f"paired run by run, staleness {k} against on-policy ({len(pairs)} pairs): run mean reward "
              f"{st.mean(d):+.3f} (95% {dlo:+.3f} to {dhi:+.3f}); never learned (run mean < 0.3) "
              f"{sum(x < 0.3 for x, _ in pairs)} against {sum(y < 0.3 for _, y in pairs)}; only on-policy "
              f"learned {only_on}, only staleness {k} {only_k} (McNemar exact p = {p_value:.2f})")
