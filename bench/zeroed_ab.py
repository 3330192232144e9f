"""Bytes the kernel zeroes for one bench/workloads.py workload, builds side by side.

    python3 bench/zeroed_ab.py --build default=VENV_A/bin/python \\
        --build main=VENV_A/bin/python,configs/minimal.yaml \\
        --build lend=VENV_B/bin/python,configs/minimal.yaml --reps 3 [--out F.json] \\
        [-- mixed --quick]

Each build runs the workload (default: mixed --quick) in a fresh process, the builds
interleaved, `reps` times; a build without a policy runs NumPy's default. Hugepage
faults are `thp_fault_alloc` of /proc/vmstat around the child (machine-wide: run it on
a quiet machine), small faults the child's minor faults less those; bytes zeroed =
small x 4 KiB + hugepages x 2 MiB, the whole process; peak RSS over the start's.
Prints the medians as a Markdown table.
"""
import argparse
import json
import os
import statistics
import subprocess

from datamem._profile.tune import thp_faults  # one reading of /proc/vmstat (installed)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(python, policy, args):
    env = dict(os.environ)
    env.pop("DATAMEM_CONFIG", None)
    if policy:
        env["DATAMEM_CONFIG"] = policy
    t0 = thp_faults()
    p = subprocess.Popen([python, os.path.join(ROOT, "bench", "workloads.py")] + args,
                         cwd=ROOT, env=env, stdout=subprocess.PIPE)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit("%s %s failed (%d)" % (python, " ".join(args), status))
    t1 = thp_faults()
    huge = t1 - t0 if t0 is not None and t1 is not None else 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    small = ru.ru_minflt - huge
    return {"handler": res["handler"], "thp": huge, "small": small, "zeroed_mb": (small * 4096 + huge * (2 << 20)) / 1e6,
            "rss_mb": (res["maxrss_kb"] - res["rss0_kb"]) * 1024 / 1e6,
            "us_per_op": res["results"].get("ns", 0) / 1e3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="append", required=True,
                    help="NAME=PYTHON[,POLICY]: an interpreter and the policy it runs under")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("workload", nargs="*", default=["mixed", "--quick"])
    a = ap.parse_args(argv)
    builds = []
    for b in a.build:
        name, _, rest = b.partition("=")
        python, _, policy = rest.partition(",")
        builds.append((name, python, policy or None))
    rows = {name: [] for name, _, _ in builds}
    for rep in range(a.reps):
        for name, python, policy in builds:
            rows[name].append(run(python, policy, a.workload))
            print("rep %d %-10s %s" % (rep, name, rows[name][-1]), flush=True)
    print("| build | hugepage faults | small faults | zeroed MB | peak RSS over start MB | us per op |")
    print("|---|---|---|---|---|---|")
    for name, samples in rows.items():
        med = {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "handler"}
        print("| %s | %.0f | %.0f | %.0f | %.0f | %.0f |" % (
            name, med["thp"], med["small"], med["zeroed_mb"], med["rss_mb"], med["us_per_op"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"builds": a.build, "workload": a.workload, "samples": rows}, f, indent=1)


if __name__ == "__main__":
    main()
