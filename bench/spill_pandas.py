"""A pandas 3 job in a memory cgroup smaller than its peak: NumPy's default
against configs/spill.yaml as shipped (a limit on the whole job's
memory), and the same job with room to spare against minimal.yaml.

The job is bench/jobs' pandas3_arrow (3M rows, groupby/merge/sort, pandas 3
with pyarrow: its strings live in Arrow's pool, its hash tables in malloc,
outside datamem's arenas). First it runs with no limit under NumPy's default
for its peak RSS and checksum; then, in a fresh cgroup (v1
memory.limit_in_bytes where mounted, else v2 memory.max; bench/spill_cgroup.py's
Cgroup) limited to TIGHT x that peak, under NumPy's default and spill.yaml;
then in one limited to ROOM x the peak, under minimal.yaml and spill.yaml.
Per run: the outcome (finished with the default's checksum, a different
checksum, or killed by a signal), wall and CPU time, minor faults, peak RSS
(ru_maxrss), the cgroup's peak usage, the arrays the spill arena served
(its `fallbacks`: each a refusal of the worker limit), the most bytes it held
at once (sampled), and the worker limit's figure of memory beside the arrays.

Needs root (a cgroup), pandas >= 3 and pyarrow, SPILL_DIR (default
/var/tmp/datamem-spill-bench, made 0700).
Usage: python3 bench/spill_pandas.py [--scale 1.0] [--reps 1]
  writes bench/results/spill_pandas.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from spill_cgroup import Cgroup, env_for  # noqa: E402

OUT = os.path.join(HERE, "results", "spill_pandas.json")
JOB = "pandas3_arrow"
TIGHT = 0.6
ROOM = 2.0
TIMEOUT_S = 300  # a run past this is thrashing (reclaiming its own code pages): killed

# Runs the job as bench/jobs/child.py does, then reads what datamem spilled.
# Under a policy with a spill arena a thread samples, every 50 ms, the bytes
# the arena holds (jemalloc's allocated bytes): the most spilled at once.
CHILD = r"""
import contextlib, io, json, runpy, sys, threading, time
sys.argv = ["child.py", sys.argv[1], "--scale", sys.argv[2]]
try:
    import datamem
except ImportError:
    datamem = None
most = [0]
done = threading.Event()
def sample():
    while not done.wait(0.05):
        a = datamem.stats()["arenas"].get("spill")
        most[0] = max(most[0], a["allocated_bytes"] if a else 0)
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    if datamem is not None and datamem.current_policy():
        threading.Thread(target=sample, daemon=True).start()
    runpy.run_path(%r, run_name="__main__")
done.set()
row = json.loads(buf.getvalue().strip().splitlines()[-1])
s = datamem.stats() if datamem is not None and datamem.current_policy() else None
if s:
    spill = s["arenas"].get("spill") or {}
    row["spilled_arrays"] = spill.get("fallbacks", 0)
    row["spilled_most_bytes"] = most[0]
    row["worker_beside_bytes"] = s["tag_bytes"].get("worker_beside")
    row["worker_limit_bytes"] = s["tag_bytes"].get("worker_limit")
print(json.dumps(row))
""" % os.path.join(HERE, "jobs", "child.py")


def spill_config(tmp, spill_dir):
    path = os.path.join(tmp, "spill.yaml")
    with open(os.path.join(ROOT, "configs", "spill.yaml")) as f:
        text = f.read().replace("/var/tmp/datamem-spill", spill_dir)
    with open(path, "w") as f:
        f.write(text)
    return path


def run(cg, config, scale):
    """One run of the job in cgroup cg (None: no cgroup)."""
    argv = [sys.executable, "-c", CHILD, JOB, str(scale)]
    env = env_for(config)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "jobs"), env.get("PYTHONPATH", "")])
    if cg is None:
        import subprocess
        p = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        rc, out, err = p.returncode, p.stdout, p.stderr
        peak = None
    else:
        cg.reset_peak()
        rc, out, err, _ = cg.run(argv, env, timeout=TIMEOUT_S)
        peak = cg.peak()
    row = {"returncode": rc, "cgroup_peak_bytes": peak}
    try:
        row.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        row["outcome"] = ("killed by signal %d" % -rc) if rc < 0 else "exit %d" % rc
        row["stderr_tail"] = err[-600:]
    return row


def outcome(row, checksum):
    if "outcome" in row:
        return row["outcome"]
    return "finished, same result" if row["checksum"] == checksum else "finished, DIFFERENT result"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    spill_dir = os.environ.get("SPILL_DIR", "/var/tmp/datamem-spill-bench")
    os.makedirs(spill_dir, mode=0o700, exist_ok=True)
    os.chmod(spill_dir, 0o700)
    minimal = os.path.join(ROOT, "configs", "minimal.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        spill = spill_config(tmp, spill_dir)
        free = [run(None, None, args.scale) for _ in range(args.reps)]
        peak = statistics.median(r["maxrss_mb"] for r in free) * (1 << 20)
        checksum = free[0]["checksum"]
        result = {"job": JOB, "scale": args.scale, "peak_rss_default_bytes": int(peak),
                  "checksum": checksum, "runs": []}
        for label, factor, configs in (("tight", TIGHT, (("default", None), ("spill.yaml", spill))),
                                       ("room", ROOM, (("minimal.yaml", minimal),
                                                       ("spill.yaml", spill)))):
            cg = Cgroup(int(peak * factor))
            try:
                for rep in range(args.reps):
                    for name, config in configs:
                        row = run(cg, config, args.scale)
                        row.update(group=label, limit_bytes=int(peak * factor), config=name,
                                   rep=rep, outcome=outcome(row, checksum))
                        result["runs"].append(row)
                        print("%-5s %4.0f MiB  %-12s %-28s wall %5s s  cpu %5s s  peak RSS %5s "
                              "MiB  spilled %s arrays, at most %s MiB at once  faults %s" % (
                                  label, peak * factor / (1 << 20), name, row["outcome"],
                                  "%.1f" % row["wall_s"] if "wall_s" in row else "-",
                                  "%.1f" % row["cpu_s"] if "cpu_s" in row else "-",
                                  "%.0f" % row["maxrss_mb"] if "maxrss_mb" in row else "-",
                                  row.get("spilled_arrays", 0),
                                  "%.0f" % (row.get("spilled_most_bytes", 0) / (1 << 20)),
                                  row.get("faults", "-")), flush=True)
            finally:
                cg.remove()
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
