"""Two builds of datamem side by side on the real jobs, in the figures that repeat.

    python3 bench/jobs_ab.py --python before=/venv-a/bin/python --python after=/venv-b/bin/python
        [--jobs J1,J2] [--policies minimal,NAME] [--scale 0.5] [--reps 3] [--out F.json]

Each venv holds one build of datamem and the jobs' libraries (bench/setup.sh).
Every (job, policy, build) runs bench/jobs/child.py in a fresh process, reps
times, in an order shuffled every repetition, with NumPy's default allocator
(no policy) beside them in the same run. Measured per run as `python -m datamem
tune` measures (datamem._profile.tune.run_once): small faults, THP faults (the
change of /proc/vmstat's thp_fault_alloc around the child, machine-wide: run on a
quiet machine), bytes zeroed (small faults x 4 KiB + THP faults x 2 MiB), CPU
time and peak RSS. The table shows medians and each build's ratio to the default.
"""
import argparse
import json
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench.jobs.__main__ import JOBS  # noqa: E402  one list of the jobs
from datamem._profile.tune import run_once  # noqa: E402  one definition of the measures (installed)

FIGURES = ["zeroed", "small", "thp", "rss", "cpu"]


def policy_path(name):
    """configs/NAME.yaml, else bench/policies/NAME.yaml (comparison policies)."""
    shipped = os.path.join(ROOT, "configs", name + ".yaml")
    return shipped if os.path.exists(shipped) else os.path.join(HERE, "policies", name + ".yaml")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", action="append", required=True, metavar="NAME=PATH",
                    help="a build: a name and the interpreter of the venv that holds it")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--policies", default="minimal",
                    help="comma-separated NAMEs: configs/NAME.yaml, else "
                    "bench/policies/NAME.yaml")
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    builds = dict(b.split("=", 1) for b in a.python)
    first = next(iter(builds.values()))
    runs = [(j, "default", first, None) for j in a.jobs.split(",")]
    for j in a.jobs.split(","):
        for p in a.policies.split(","):
            for name, py in builds.items():
                runs.append((j, p, name, py))
    rng = random.Random(a.seed)
    samples = {}
    for rep in range(a.reps):
        rng.shuffle(runs)
        for job, pol, name, py in runs:
            interp = first if pol == "default" else py
            cmd = [interp, os.path.join(HERE, "jobs", "child.py"), job, "--scale", str(a.scale)]
            policy = None if pol == "default" else policy_path(pol)
            r = run_once(cmd, policy)
            if not r["finished"]:
                sys.exit("%s %s %s failed: %s" % (job, pol, name, r["error"]))
            key = "%s|%s|%s" % (job, pol, "" if pol == "default" else name)
            samples.setdefault(key, []).append(r)
            print("rep %d %-40s zeroed %7.1f MB rss %6.1f MB" % (rep, key, r["zeroed"] / 1e6,
                                                                  r["rss"] / 1e6), file=sys.stderr)
    med = {k: {f: statistics.median(r[f] or 0 for r in v) for f in FIGURES} for k, v in samples.items()}
    print("| job | policy | build | zeroed MB | small faults | THP faults | peak RSS MB | CPU s |"
          " zeroed / default | RSS / default |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for job in a.jobs.split(","):
        d = med["%s|default|" % job]
        keys = ["%s|default|" % job] + ["%s|%s|%s" % (job, p, n) for p in a.policies.split(",")
                                         for n in builds]
        for k in keys:
            m = med[k]
            _, pol, name = k.split("|")
            print("| %s | %s | %s | %.1f | %d | %d | %.1f | %.2f | %.3f | %.3f |" % (
                job, pol, name or "-", m["zeroed"] / 1e6, m["small"], m["thp"], m["rss"] / 1e6,
                m["cpu"], m["zeroed"] / d["zeroed"], m["rss"] / d["rss"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"argv": sys.argv, "samples": samples, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
