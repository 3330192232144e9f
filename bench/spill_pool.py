"""A 4-worker multiprocessing.Pool whose workers together hold more than their
memory cgroup allows: NumPy's default against configs/spill.yaml as shipped
(a limit on the whole job's memory), and the same job with room to
spare against minimal.yaml and spill.yaml.

Each of WORKERS Pool workers holds GIB_PER_WORKER of written float64 arrays
(128 MiB each, np.arange times a per-array factor, so every page is written),
then checks every array's sum against the closed form and returns the sum of
them all. A meeting point before and after the allocation (a flag per worker
in shared memory) puts one task on each worker and has every worker's arrays
held at the same time (one a killed worker never reaches is passed after
min(30 s, TIMEOUT / 4)). The parent (the python
that makes the Pool) runs inside a fresh v1 memory cgroup (bench/spill_cgroup.py's
Cgroup; memory.memsw set to the same limit where present) limited to LIMIT_GIB,
under NumPy's default and spill.yaml, once per start method (--methods: fork,
spawn, forkserver); then in one of ROOM x the workers' total under minimal.yaml
and spill.yaml, where spill.yaml must spill nothing.

A worker the kernel OOM-kills is replaced by the Pool, and its task is lost:
Pool.map would wait forever. The parent waits on map_async(...).get(TIMEOUT)
instead and reports the workers that died and their exit codes; a parent that
overruns TIMEOUT + GRACE is killed with every task in the cgroup. Each worker
also writes its own report (spilled arrays, bytes) to a file once its arrays
are held and checked, so the survivors of a run that timed out are counted.

Per run: the outcome (finished with the right results, wrong results, a worker
killed / timed out, or the parent killed), the Pool's wall time and the
process's, the cgroup's peak usage (memory.max_usage_in_bytes) and OOM kills
(memory.oom_control), and per worker its peak RSS (VmHWM), the held arrays the
spill arena served (datamem.arena_of), the spill arena's `fallbacks` during the
task (each a refusal of the worker limit: bench/spill_pandas.py's "spilled
arrays", but it also counts the small buffers NumPy allocates once the limit is
reached, such as each sum's 0-d result), the bytes it held (the spill arena's
allocated_bytes with every array held) and the worker limit and the memory
beside the arrays datamem computed.

Needs root (a cgroup; v1 memory.limit_in_bytes, else v2 memory.max) and
SPILL_DIR (default /var/tmp/datamem-spill-bench, made 0700).
Usage: python3 bench/spill_pool.py [--reps 1] [--methods fork,spawn]
           [--workers 4] [--gib-per-worker 1.0] [--limit-gib 2.5]
  writes bench/results/spill_pool.json and bench/results/spill_pool.md
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from spill_cgroup import Cgroup, env_for  # noqa: E402
from spill_pandas import spill_config  # noqa: E402

OUT = os.path.join(HERE, "results", "spill_pool.json")
OUT_MD = os.path.join(HERE, "results", "spill_pool.md")
ARRAY_MIB = 128
ROOM = 2.0     # the room group: ROOM x the workers' total
TIMEOUT_S = 120  # map_async(...).get(TIMEOUT_S): a lost task never comes back
GRACE_S = 90   # the parent's own overrun past TIMEOUT_S (start-up, tear-down)
# spill.yaml with DATAMEM_MEMORY_LIMIT set to the group's limit: each process
# a budget of its own (70% of the group each), as before the group's charge
# counted; the control for "one budget for the group"
PER_PROCESS = "spill.yaml, each process its own 70%"

MIB = 1 << 20

# The parent inside the cgroup; a file, so that spawn and forkserver workers
# can import `work` from it (as __mp_main__). argv: method workers arrays mib
# timeout reports-dir. Prints one JSON line.
CHILD = r'''
import json, multiprocessing as mp, os, sys, time
import numpy as np

ARRIVED = None


def init(arrived):
    global ARRIVED
    ARRIVED = arrived


def meet(phase, i, workers, timeout):
    """Waits for every worker to reach phase: False if one never came (killed)
    within timeout. One flag per worker, no lock: a multiprocessing.Barrier
    hangs its survivors for good once a waiter is SIGKILLed (Condition.notify
    waits for the dead one to wake)."""
    ARRIVED[phase * workers + i] = 1
    end = time.monotonic() + timeout
    while sum(ARRIVED[phase * workers:(phase + 1) * workers]) < workers:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def spill_stats():
    try:
        import datamem
    except ImportError:
        return None
    if not datamem.current_policy():
        return None
    s = datamem.stats()
    a = s["arenas"].get("spill") or {}
    t = s["tag_bytes"]
    return {"fallbacks": a.get("fallbacks", 0), "allocated": a.get("allocated_bytes", 0),
            "disk": a.get("backing_disk_bytes", 0), "resident": a.get("backing_resident_bytes", 0),
            "worker_limit": t.get("worker_limit"), "worker_beside": t.get("worker_beside"),
            "worker_refused": t.get("worker_refused")}


def work(job):
    i, n, mib, reports, wait, workers = job
    elems = (mib << 20) // 8
    before = spill_stats()
    # one task per worker (a worker blocked here takes no other), all held at once
    met = [meet(0, i, workers, wait)]
    t0 = time.monotonic()
    held = []
    for k in range(n):
        a = np.arange(elems, dtype=np.float64)
        a *= i + k + 1
        held.append(a)
    held_s = time.monotonic() - t0
    met.append(meet(1, i, workers, wait))
    during = spill_stats()
    on_spill = None
    if during is not None:
        import datamem
        on_spill = sum(datamem.arena_of(a) == "spill" for a in held)
    want = elems * (elems - 1) / 2
    sums = [float(a.sum()) for a in held]
    bad = sum(abs(s - want * (i + k + 1)) > 1e-12 * want * (i + k + 1)
              for k, s in enumerate(sums))
    hwm = [int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmHWM")]
    row = {"worker": i, "pid": os.getpid(), "checksum": sum(sums), "bad_arrays": bad,
           "held_s": round(held_s, 2), "task_s": round(time.monotonic() - t0, 2),
           "peak_rss_bytes": hwm[0], "on_spill": on_spill, "all_met": met}
    if during is not None:
        row.update(spilled_arrays=during["fallbacks"] - before["fallbacks"],
                   spill_held_bytes=during["allocated"], spill_disk_bytes=during["disk"],
                   spill_resident_bytes=during["resident"],
                   worker_limit_bytes=during["worker_limit"],
                   worker_beside_bytes=during["worker_beside"],
                   worker_refused=during["worker_refused"] - before["worker_refused"])
    tmp = os.path.join(reports, "%d.tmp" % i)
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.rename(tmp, os.path.join(reports, "%d.json" % i))
    return row


def main():
    method, workers, n, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    timeout, reports = float(sys.argv[5]), sys.argv[6]
    ctx = mp.get_context(method)
    t0 = time.monotonic()
    pool = ctx.Pool(workers, initializer=init, initargs=(ctx.RawArray("b", 2 * workers),))
    first = list(pool._pool)
    row = {"numpy": np.__version__, "python": sys.version.split()[0]}
    try:
        jobs = [(i, n, mib, reports, min(30.0, timeout / 4), workers) for i in range(workers)]
        pool.map_async(work, jobs, chunksize=1).get(timeout)
        row["pool"] = "finished"
    except mp.TimeoutError:
        row["pool"] = "timeout"
    except Exception as e:
        row["pool"] = "raised %s: %s" % (type(e).__name__, str(e)[:300])
    row["wall_s"] = round(time.monotonic() - t0, 2)
    row["exitcodes"] = [p.exitcode for p in first]
    row["workers"] = []
    for name in sorted(os.listdir(reports)):
        if name.endswith(".json"):
            with open(os.path.join(reports, name)) as f:
                row["workers"].append(json.load(f))
    print(json.dumps(row), flush=True)
    if row["pool"] == "finished":
        pool.close()
        pool.join()
        return
    for p in first + list(pool._pool):
        try:
            p.kill()
        except Exception:
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
'''


def kill_tasks(cg):
    """SIGKILLs every task in cg until none is left (10 s at most)."""
    procs = os.path.join(cg.path, "cgroup.procs")
    for _ in range(100):
        with open(procs) as f:
            pids = [int(x) for x in f.read().split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def run_in(cg, argv, env, timeout):
    """Runs argv in cg; past timeout, kills every task in cg (the Pool's
    workers hold the output pipes too). Returns (rc, out, err, wall, overran)."""
    procs = os.path.join(cg.path, "cgroup.procs")
    wrapped = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs] + argv
    t0 = time.monotonic()
    p = subprocess.Popen(wrapped, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT)
    overran = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        overran = True
        kill_tasks(cg)
        out, err = p.communicate()
    # a worker can outlive a parent that exited: none may stay for the next run
    kill_tasks(cg)
    return p.returncode, out, err, time.monotonic() - t0, overran


def read_leaf(cg, leaf):
    try:
        with open(os.path.join(cg.path, leaf)) as f:
            return f.read()
    except OSError:
        return None


def oom_kills(cg):
    text = read_leaf(cg, "memory.oom_control") or read_leaf(cg, "memory.events") or ""
    for line in text.splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return None


def make_group(limit):
    cg = Cgroup(limit)
    if cg.v1 and os.path.exists(os.path.join(cg.path, "memory.memsw.limit_in_bytes")):
        cg._write("memory.memsw.limit_in_bytes", str(limit))
    return cg


def outcome(row, want):
    """finished, right results / finished, WRONG results / a worker killed /
    timed out / the parent killed."""
    if row.get("overran"):
        return "parent overran %d s: killed with its workers" % row["outer_timeout_s"]
    if "pool" not in row:
        rc = row["returncode"]
        return ("parent killed by signal %d" % -rc) if rc < 0 else "parent exit %d" % rc
    dead = [c for c in row["exitcodes"] if c is not None]
    if row["pool"] == "finished":
        ok = (len(row["workers"]) == len(want)
              and all(w["bad_arrays"] == 0 and w["checksum"] == want[w["worker"]]
                      for w in row["workers"]))
        return "finished, right results" if ok else "finished, WRONG results"
    if row["pool"] == "timeout":
        if dead or row.get("oom_kills"):
            sigs = sorted(set("SIGKILL" if c == -9 else str(c) for c in dead))
            return "%d worker(s) killed (%s), %d of %d reported; get() timed out after %d s" % (
                len(dead), ",".join(sigs) or "?", len(row["workers"]), len(want), row["timeout_s"])
        return "timed out after %d s, no worker died" % row["timeout_s"]
    return row["pool"]


def run(cg, config, method, args, child, tmp, own_limit=None):
    """One Pool run in cg under config (None: NumPy's default); own_limit:
    DATAMEM_MEMORY_LIMIT for every process (each its own budget)."""
    reports = tempfile.mkdtemp(dir=tmp)
    argv = [sys.executable, child, method, str(args.workers), str(args.arrays), str(ARRAY_MIB),
            str(args.timeout), reports]
    cg.reset_peak()
    oom0 = oom_kills(cg)
    outer = args.timeout + GRACE_S
    env = env_for(config)
    if own_limit:
        env["DATAMEM_MEMORY_LIMIT"] = str(own_limit)
    rc, out, err, wall, overran = run_in(cg, argv, env, outer)
    oom1 = oom_kills(cg)
    row = {"returncode": rc, "process_wall_s": round(wall, 2), "cgroup_peak_bytes": cg.peak(),
           "oom_kills": None if oom0 is None else oom1 - oom0, "overran": overran,
           "outer_timeout_s": outer, "timeout_s": args.timeout}
    try:
        row.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        row["stderr_tail"] = err[-600:]
    if row.get("pool", "finished") != "finished":
        row["stderr_tail"] = err[-600:]
    return row


def expected(args):
    """Per worker, the sum of its arrays' sums (the closed form)."""
    elems = (ARRAY_MIB << 20) // 8
    want = elems * (elems - 1) / 2
    return [sum(want * (i + k + 1) for k in range(args.arrays)) for i in range(args.workers)]


def fmt_mib(n):
    return "-" if n is None else "%.0f" % (n / MIB)


def per_worker(row, key, scale=1):
    vals = [w.get(key) for w in sorted(row.get("workers", []), key=lambda w: w["worker"])]
    if not vals or all(v is None for v in vals):
        return "-"
    return "/".join("-" if v is None else "%.0f" % (v / scale) for v in vals)


def line(row):
    return ("%-5s %5.0f MiB  %-10s %-12s %-70s wall %6s s  process %6.1f s  cgroup peak %5s MiB"
            "  OOM kills %s  spilled %s arrays (%s refusals), %s MiB held"
            "  worker peak RSS %s MiB" % (
                row["group"], row["limit_bytes"] / MIB, row["method"], row["config"],
                row["outcome"], "%.1f" % row["wall_s"] if "wall_s" in row else "-",
                row["process_wall_s"], fmt_mib(row["cgroup_peak_bytes"]), row["oom_kills"],
                per_worker(row, "on_spill"), per_worker(row, "spilled_arrays"),
                per_worker(row, "spill_held_bytes", MIB), per_worker(row, "peak_rss_bytes", MIB)))


def md_row(row):
    wl = [w.get("worker_limit_bytes") for w in row.get("workers", [])]
    return "| %s | %.2f | %s | %s | %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        row["group"], row["limit_bytes"] / (1 << 30), row["method"], row["config"],
        row["outcome"], "%.1f" % row["wall_s"] if "wall_s" in row else "-",
        row["process_wall_s"], fmt_mib(row["cgroup_peak_bytes"]),
        "-" if row["oom_kills"] is None else row["oom_kills"],
        per_worker(row, "on_spill"), per_worker(row, "spilled_arrays"),
        per_worker(row, "spill_held_bytes", MIB),
        fmt_mib(wl[0]) if wl and wl[0] is not None else "-",
        per_worker(row, "worker_beside_bytes", MIB), per_worker(row, "peak_rss_bytes", MIB))


def write_md(result, argv):
    first = next((r for r in result["runs"] if "numpy" in r), {})
    text = [
        "# A 4-worker Pool in a memory cgroup smaller than its workers' arrays", "",
        "`python3 bench/spill_pool.py %s` (root: it makes v1 memory cgroups;" % " ".join(argv),
        "SPILL_DIR=%s), %d cores, %.0f GiB, Linux %s, %s swap, Python %s, NumPy %s." % (
            result["spill_dir"], os.cpu_count(), result["ram_bytes"] / (1 << 30),
            result["kernel"], "no" if not result["swap_bytes"] else fmt_mib(result["swap_bytes"])
            + " MiB", first.get("python", platform.python_version()), first.get("numpy", "?")),
        "%d workers, each holding %d arrays of %d MiB (%.2f GiB, %.2f GiB in all); the tight" % (
            result["workers"], result["arrays"], ARRAY_MIB, result["gib_per_worker"],
            result["workers"] * result["gib_per_worker"]),
        "group is %.2f GiB, the room group %.2f GiB. `map_async(...).get(%d)`; the parent is" % (
            result["limit_gib"], result["room_gib"], result["timeout_s"]),
        "killed with its workers past %d s. `spill_pool.json` has the runs." % (
            result["timeout_s"] + GRACE_S), "",
        "Per-worker columns list the workers that reported (a killed worker's task never",
        "does), in worker order: spilled arrays = held arrays `datamem.arena_of` puts on the",
        "spill arena; refusals = the spill arena's `fallbacks` during the task (the worker",
        "limit's refusals: the arrays and the small buffers NumPy allocates past the limit);",
        "held = the spill arena's allocated bytes with every array held; worker limit and",
        "beside = datamem's worker limit and its figure of the memory beside the arrays.", "",
        "| group | limit GiB | start | policy | outcome | Pool wall s | process s |"
        " cgroup peak MiB | OOM kills | spilled arrays | refusals | spill held MiB |"
        " worker limit MiB | beside MiB | worker peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    text += [md_row(r) for r in result["runs"]]
    with open(OUT_MD, "w") as f:
        f.write("\n".join(text) + "\n")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--methods", default="fork,spawn",
                    help="comma-separated start methods: fork, spawn, forkserver")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--gib-per-worker", type=float, default=1.0)
    ap.add_argument("--limit-gib", type=float, default=2.5)
    ap.add_argument("--room-gib", type=float, default=None,
                    help="the room group (default ROOM x the workers' total)")
    ap.add_argument("--timeout", type=int, default=TIMEOUT_S, help="map_async(...).get(timeout)")
    args = ap.parse_args()
    args.arrays = max(1, round(args.gib_per_worker * 1024 / ARRAY_MIB))
    if args.room_gib is None:
        args.room_gib = ROOM * args.workers * args.gib_per_worker
    return args


def meminfo(key):
    with open("/proc/meminfo") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) << 10
    return None


def main():
    args = parse()
    spill_dir = os.environ.get("SPILL_DIR", "/var/tmp/datamem-spill-bench")
    os.makedirs(spill_dir, mode=0o700, exist_ok=True)
    os.chmod(spill_dir, 0o700)
    minimal = os.path.join(ROOT, "configs", "minimal.yaml")
    want = expected(args)
    result = {"workers": args.workers, "gib_per_worker": args.gib_per_worker,
              "arrays": args.arrays, "array_mib": ARRAY_MIB, "limit_gib": args.limit_gib,
              "room_gib": args.room_gib, "timeout_s": args.timeout, "spill_dir": spill_dir,
              "kernel": os.uname().release, "ram_bytes": meminfo("MemTotal"),
              "swap_bytes": meminfo("SwapTotal"), "checksums": want, "runs": []}
    methods = [m for m in args.methods.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        child = os.path.join(tmp, "spill_pool_child.py")
        with open(child, "w") as f:
            f.write(CHILD)
        spill = spill_config(tmp, spill_dir)
        for label, gib, configs in (("tight", args.limit_gib, (("default", None),
                                                               ("spill.yaml", spill),
                                                               (PER_PROCESS, spill))),
                                    ("room", args.room_gib, (("minimal.yaml", minimal),
                                                             ("spill.yaml", spill)))):
            limit = int(gib * (1 << 30))
            cg = make_group(limit)
            try:
                for rep in range(args.reps):
                    for method in methods:
                        for name, config in configs:
                            own = limit if name == PER_PROCESS else None
                            row = run(cg, config, method, args, child, tmp, own)
                            row.update(group=label, limit_bytes=limit, method=method,
                                       config=name, rep=rep)
                            row["outcome"] = outcome(row, want)
                            result["runs"].append(row)
                            print(line(row), flush=True)
            finally:
                kill_tasks(cg)
                cg.remove()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    write_md(result, sys.argv[1:])
    print("wrote", OUT, "and", OUT_MD)


if __name__ == "__main__":
    main()
