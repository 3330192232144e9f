"""Two Dask workers (or joblib's loky workers, --engine loky) on one host in one
memory cgroup whose tasks together hold more than it allows: NumPy's default
against configs/spill.yaml as shipped, which gives a container one budget
across its processes.

A LocalCluster of WORKERS worker processes (one thread each; Dask's own
memory_limit from the cgroup, its nanny and spilling as they come) runs one
task per worker at once; each task holds GIB_PER_TASK of written float64
arrays (128 MiB each), checks every sum against the closed form and returns
the sum of them all. The script that makes the cluster runs in a fresh v1
memory cgroup (bench/spill_pool.py's make_group) limited to LIMIT_GIB, under
NumPy's default and spill.yaml exported as DATAMEM_CONFIG (no datamem Dask
plugin: the workers inherit the environment, and with no
DATAMEM_MEMORY_LIMIT their `worker_limit: 70%` is a share of the group's
limit, one budget for both). Per run: the outcome (right results, wrong, a
task lost to a killed worker, or timed out), wall time, the cgroup's peak and
OOM kills, and per task the arrays the spill arena held.

Needs root, distributed, SPILL_DIR (default /var/tmp/datamem-spill-bench).
With --engine loky, joblib.Parallel(n_jobs=WORKERS, backend="loky") runs the
same tasks instead; a killed worker fails the whole call (TerminatedWorkerError).

Usage: python3 bench/spill_dask.py [--reps 1] [--workers 2] [--gib-per-task 1.5]
           [--limit-gib 2.5] [--engine dask|loky]
  writes bench/results/spill_dask.{json,md} (loky: spill_loky.{json,md})
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from spill_cgroup import env_for  # noqa: E402
from spill_pandas import spill_config  # noqa: E402
from spill_pool import kill_tasks, make_group, oom_kills, run_in  # noqa: E402

OUT = os.path.join(HERE, "results", "spill_dask.json")
OUT_MD = os.path.join(HERE, "results", "spill_dask.md")
ARRAY_MIB = 128
TIMEOUT_S = 180
MIB = 1 << 20

# argv: workers arrays-per-task timeout. Prints one JSON line.
CHILD = r'''
import json, sys, time
import numpy as np
from distributed import Client, LocalCluster, wait


def hold(i, arrays, mib):
    import datamem_probe
    n = (mib << 20) // 8
    held = [np.arange(n, dtype=np.float64) * (i + k + 1) for k in range(arrays)]
    want = n * (n - 1) / 2
    bad = sum(float(a.sum()) != want * (i + k + 1) for k, a in enumerate(held))
    return {"task": i, "bad": bad, "sum": sum(float(a.sum()) for a in held),
            "on_spill": datamem_probe.on_spill(held)}


def by_loky(workers, arrays, timeout):
    from joblib import Parallel, delayed
    try:
        return Parallel(n_jobs=workers, backend="loky", timeout=timeout)(
            delayed(hold)(i, arrays, 128) for i in range(workers))
    except Exception as e:  # a killed worker: TerminatedWorkerError
        return [{"task": i, "status": "lost", "error": repr(e)} for i in range(workers)]


def main():
    workers, arrays, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    t0 = time.monotonic()
    if sys.argv[4] == "loky":
        res = by_loky(workers, arrays, timeout)
        print(json.dumps({"wall_s": round(time.monotonic() - t0, 2), "tasks": res}), flush=True)
        return
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        futs = [client.submit(hold, i, arrays, 128, pure=False, key="hold-%d" % i)
                for i in range(workers)]
        done, pending = wait(futs, timeout=timeout, return_when="ALL_COMPLETED")
        res = []
        for f in futs:
            if f.status == "finished":
                res.append(f.result())
            else:
                res.append({"task": futs.index(f), "status": f.status,
                            "error": repr(f.exception()) if f.status == "error" else None})
        print(json.dumps({"wall_s": round(time.monotonic() - t0, 2), "tasks": res}), flush=True)


if __name__ == "__main__":
    main()
'''

# Imported by the task in each worker: which held arrays the spill arena serves.
PROBE = r'''
def on_spill(held):
    try:
        import datamem
    except ImportError:
        return None
    if not datamem.current_policy():
        return None
    return sum(datamem.arena_of(a) == "spill" for a in held)
'''


def outcome(row, want):
    if row.get("overran"):
        return "timed out: killed with its workers"
    tasks = row.get("tasks")
    if tasks is None:
        return "script exit %s" % row["returncode"]
    lost = [t for t in tasks if "sum" not in t]
    if lost:
        why = sorted(set((t.get("error") or t.get("status") or "?")[:60] for t in lost))
        return "%d of %d tasks lost (%s)" % (len(lost), len(tasks), "; ".join(why))
    ok = all(t["bad"] == 0 and t["sum"] == want[t["task"]] for t in tasks)
    text = "finished, right results" if ok else "finished, WRONG results"
    if row.get("oom_kills"):  # the nanny restarts a killed worker, the task runs again
        text += " after %d worker(s) OOM-killed (their tasks run again)" % row["oom_kills"]
    return text


def run(cg, config, args, child_dir):
    argv = [sys.executable, os.path.join(child_dir, "dask_child.py"), str(args.workers),
            str(args.arrays), str(TIMEOUT_S), args.engine]
    env = env_for(config)
    env["PYTHONPATH"] = os.pathsep.join([child_dir, env.get("PYTHONPATH", "")])
    cg.reset_peak()
    oom0 = oom_kills(cg)
    rc, out, err, wall, overran = run_in(cg, argv, env, TIMEOUT_S + 90)
    row = {"returncode": rc, "process_wall_s": round(wall, 2), "overran": overran,
           "cgroup_peak_bytes": cg.peak(), "oom_kills": oom_kills(cg) - oom0}
    try:
        row.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        row["stderr_tail"] = err[-800:]
    return row


def md(result, rows):
    what = ("Dask workers (a LocalCluster: processes, one thread each; no datamem Dask "
            "plugin)" if result["engine"] == "dask" else "joblib loky workers")
    text = ["# %s in a memory cgroup smaller than their tasks' arrays" % what, "",
            "`python3 bench/spill_dask.py %s` (root), %d workers, each task holding %d arrays of %d MiB (%.2f GiB), in a v1 memory "
            "cgroup of %.2f GiB, DATAMEM_CONFIG exported." % (
                " ".join(sys.argv[1:]), result["workers"], result["arrays"], ARRAY_MIB,
                result["gib_per_task"], result["limit_gib"]), "",
            "| policy | outcome | wall s | cgroup peak MiB | OOM kills | arrays on spill |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        spilled = "/".join("-" if t.get("on_spill") is None else str(t["on_spill"])
                           for t in r.get("tasks") or [])
        text.append("| %s | %s | %s | %.0f | %s | %s |" % (
            r["config"], r["outcome"], r.get("wall_s", "-"), r["cgroup_peak_bytes"] / MIB,
            r["oom_kills"], spilled or "-"))
    with open(OUT_MD, "w") as f:
        f.write("\n".join(text) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gib-per-task", type=float, default=1.5)
    ap.add_argument("--limit-gib", type=float, default=2.5)
    ap.add_argument("--engine", choices=("dask", "loky"), default="dask",
                    help="dask: a LocalCluster; loky: joblib.Parallel(backend='loky')")
    args = ap.parse_args()
    if args.engine == "loky":
        global OUT, OUT_MD
        OUT, OUT_MD = (p.replace("spill_dask", "spill_loky") for p in (OUT, OUT_MD))
    args.arrays = max(1, round(args.gib_per_task * 1024 / ARRAY_MIB))
    spill_dir = os.environ.get("SPILL_DIR", "/var/tmp/datamem-spill-bench")
    os.makedirs(spill_dir, mode=0o700, exist_ok=True)
    n = (ARRAY_MIB << 20) // 8
    want = [sum(n * (n - 1) / 2 * (i + k + 1) for k in range(args.arrays))
            for i in range(args.workers)]
    result = {"engine": args.engine, "workers": args.workers, "arrays": args.arrays, "gib_per_task": args.gib_per_task,
              "limit_gib": args.limit_gib, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in (("dask_child.py", CHILD), ("datamem_probe.py", PROBE)):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        configs = (("default", None), ("spill.yaml", spill_config(tmp, spill_dir)))
        cg = make_group(int(args.limit_gib * (1 << 30)))
        try:
            for rep in range(args.reps):
                for name, config in configs:
                    row = run(cg, config, args, tmp)
                    row.update(config=name, rep=rep, outcome=outcome(row, want))
                    result["runs"].append(row)
                    print(name, row["outcome"], row.get("wall_s"), row["oom_kills"], flush=True)
        finally:
            kill_tasks(cg)
            cg.remove()
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    md(result, result["runs"])
    print("wrote", OUT, "and", OUT_MD)


if __name__ == "__main__":
    main()
