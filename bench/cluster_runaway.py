"""One runaway task among many on a small cluster: what Dask, and Ray,
do alone, and what they do under datamem's plugin with a tag limit or a worker limit.

Dask: LocalCluster(n_workers=2, processes=True, threads_per_worker=2,
memory_limit="1.5GiB"). 200 small tasks (`keep`, 1 MiB each) run and keep their
results on the workers; then one task (`runaway`) allocates 60 x 128 MiB,
touched, kept in a list. The client then gathers the 200 results and the
runaway's. Recorded: worker deaths (a scheduler plugin counts remove_worker
after the cluster is ready), recomputed tasks (a `keep` task that reached memory
more than once), the outcome of each side, wall time from submitting the runaway
to having every outcome, and the runaway's error message.

Ray: ray.init(num_cpus=2) with 200 small tasks whose results the driver holds and
one runaway. Ray alone has no per-worker limit; its node memory monitor kills a
worker when the node passes RAY_memory_usage_threshold of RAM. This script sets
that threshold so the node may grow by about 3 GiB over what it uses at the start
(the machine is shared: the number moves with the other processes), and bounds
the wait for the runaway at BOUND_S (60 s). Recorded: workers killed (Ray's OutOfMemoryError retries), the
outcome, the error.

Modes (each in a fresh interpreter: a plugin leaves variables in the nanny's
process, which LocalCluster shares with the client):
  dask-alone, dask-tag-limit, dask-worker-limit (75%), dask-worker-limit-85,
  dask-spill (worker_limit 75% + worker_spill to a file-backed arena in /var/tmp;
  also records each worker's peak RSS, sampled every 20 ms, and its spill stats),
  ray-alone, ray-tag-limit

Usage: .venv-engines/bin/python bench/cluster_runaway.py [MODE ...]
  (no mode: all; writes bench/results/cluster_runaway.json)
  dask-tag-limit --page DIR: also, while two tasks hold 96 MiB each, the tag table and
  each worker's page (headless Chromium) into DIR (docs/cluster.md shows them)
"""
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "cluster_runaway.json")
N_KEEP = 200
KEEP_BYTES = 1 << 20
RUNAWAY_BLOCKS = 60
BLOCK = 128 << 20
BOUND_S = 60
MODES = ("dask-alone", "dask-tag-limit", "dask-worker-limit", "dask-worker-limit-85", "dask-spill",
         "ray-alone", "ray-tag-limit")

POLICY_TAG = """version: 1
default: general
arenas:
  general: {}
tag_limits:
  - {tag: "runaway*", limit: 256MiB}
"""
POLICY_WORKER = """version: 1
default: general
arenas:
  general: {}
worker_limit: {share}
"""
# What passes worker_limit goes on from a file on disk instead of failing
# (docs/spill-and-limits.md, "When arrays outgrow RAM"); {dir} is made for the run.
POLICY_SPILL = """version: 1
default: general
arenas:
  general: {}
  spill:
    decay: {dirty: 1s}
    backing: {dir: "{dir}", resident_max: 128MiB}
worker_limit: 75%
worker_spill: spill
"""
SPILL_ROOT = "/var/tmp"  # local disk here (/tmp may be tmpfs elsewhere: that is RAM)


def keep(i):
    import numpy as np
    return np.full(KEEP_BYTES // 8, float(i))


def runaway(log=None):
    import numpy as np
    if log:  # one line per attempt (Ray retries a task whose worker it killed)
        with open(log, "a") as f:
            f.write("%d\n" % os.getpid())
    hold = []
    for _ in range(RUNAWAY_BLOCKS):
        hold.append(np.ones(BLOCK // 8))  # ones: every page touched, so RSS grows
    return len(hold)


def _error(e):
    """Type and message; for a Ray task error, the line that names the cause
    (Ray puts the worker's traceback first)."""
    import re
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if len(lines) > 1:
        named = [l for l in lines if "Error" in l.split(":", 1)[0] or l.startswith("datamem:")]
        text = (named or lines)[-1]
    return {"type": type(e).__name__, "message": text[:600]}


# ---- Dask -------------------------------------------------------------------------------------

class _Counter:
    """Scheduler plugin: workers removed and, per key, how often it reached memory."""

    def __init__(self):
        self.removed = 0
        self.memory = {}

    def remove_worker(self, scheduler=None, worker=None, **kwargs):
        self.removed += 1

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory":
            self.memory[key] = self.memory.get(key, 0) + 1


def _install_counter(dask_scheduler):
    from distributed.diagnostics.plugin import SchedulerPlugin

    class Counter(_Counter, SchedulerPlugin):
        name = "runaway-counter"

    dask_scheduler.add_plugin(Counter(), name="runaway-counter")


def _read_counter(dask_scheduler):
    c = dask_scheduler.plugins["runaway-counter"]
    return {"removed": c.removed, "memory": {str(k): v for k, v in c.memory.items()}}


def hold_for(seconds):
    """A task that keeps 96 MiB for a while: the job is still running when the
    page is taken."""
    import numpy as np
    a = np.ones((96 << 20) // 8)
    time.sleep(seconds)
    return float(a[0])


def _page(client, out_dir):
    """While two `hold_for` tasks run: the tag table (text) and each worker's
    page in headless Chromium (1280x1000) into out_dir."""
    import shutil
    import datamem.dask
    os.makedirs(out_dir, exist_ok=True)
    busy = client.map(hold_for, [20, 20], pure=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # both holding their bytes
        live = [r for r in datamem.dask.tag_table(client) if r[1] == "hold_for" and r[2]]
        if len(live) == 2:
            break
        time.sleep(0.1)
    with open(os.path.join(out_dir, "cluster-tags.txt"), "w") as f:
        f.write(datamem.dask.format_table(datamem.dask.tag_table(client)) + "\n")
    urls = sorted(u for u in client.run(datamem.stats_url).values() if u)
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    for i, url in enumerate(urls):
        root = url.rsplit("/", 1)[0] + "/"
        with tempfile.TemporaryDirectory() as prof:
            subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                            "--hide-scrollbars", "--user-data-dir=" + prof,
                            "--virtual-time-budget=5000", "--window-size=1280,1000",
                            "--screenshot=" + os.path.join(out_dir, "cluster-page-%d.png" % i),
                            root], capture_output=True, timeout=90)
    client.gather(busy)


def run_dask(mode, page_dir=None):

    spill_dir = tempfile.mkdtemp(prefix="datamem-spill-", dir=SPILL_ROOT)  # mode 0700
    policy = {"dask-tag-limit": POLICY_TAG,
              "dask-worker-limit": POLICY_WORKER.replace("{share}", "75%"),
              "dask-worker-limit-85": POLICY_WORKER.replace("{share}", "85%"),
              "dask-spill": POLICY_SPILL.replace("{dir}", spill_dir)}.get(mode)
    try:
        return _run_dask(mode, policy, page_dir, spill_dir)
    finally:
        os.rmdir(spill_dir)  # the spill files have no name: nothing is left in it


def _run_dask(mode, policy, page_dir, spill_dir):
    from dask.distributed import Client, LocalCluster, wait
    import datamem.dask

    out = {"mode": mode, "workers": 2, "memory_limit": "1.5GiB", "threads_per_worker": 2,
           "keep_tasks": N_KEEP, "runaway": "%d x %d MiB" % (RUNAWAY_BLOCKS, BLOCK >> 20),
           "policy": policy}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                         memory_limit="1.5GiB", dashboard_address="127.0.0.1:0",
                         host="127.0.0.1") as cluster, Client(cluster) as client:
        if policy:
            path = os.path.join(tmp, "policy.yaml")
            with open(path, "w") as f:
                f.write(policy)
            http = "127.0.0.1:0" if page_dir else None
            client.register_plugin(datamem.dask.Policy(path, stats_http=http))
            client.wait_for_workers(2, timeout=60)
        client.run_on_scheduler(_install_counter)
        kept = client.map(keep, range(N_KEEP), pure=False)
        wait(kept)
        t0 = time.monotonic()
        sampler = _RssSampler(client.run(os.getpid).values()) if mode == "dask-spill" else None
        bad = client.submit(runaway, pure=False)
        wait([bad], timeout=300)
        if sampler:
            out["worker_rss_peak_MiB"] = sampler.stop()
        if page_dir:
            _page(client, page_dir)
        try:
            got = client.gather(kept)
            out["results"] = len(got)
            out["results_ok"] = all(float(a[0]) == float(i) for i, a in enumerate(got))
        except Exception as e:
            out["results"] = 0
            out["results_error"] = _error(e)
        try:
            out["runaway_outcome"] = {"ok": bad.result()}
        except Exception as e:
            out["runaway_outcome"] = _error(e)
        out["wall_s"] = round(time.monotonic() - t0, 2)
        counts = client.run_on_scheduler(_read_counter)
        keep_counts = [v for k, v in counts["memory"].items() if k.startswith("keep-")]
        out["worker_deaths"] = counts["removed"]
        out["recomputed"] = sum(v - 1 for v in keep_counts if v > 1)
        if mode == "dask-spill":  # what each worker spilled, and its resident set now
            out["spill"] = client.run(_spill_stats)
        if policy:
            try:
                out["tags"] = [list(r) for r in datamem.dask.tag_table(client)]
            except Exception as e:  # a worker gone
                out["tags_error"] = _error(e)
    return out


class _RssSampler:
    """The highest resident set of each worker process, sampled every 20 ms
    (what the nanny checks every 100 ms against 95% of memory_limit)."""

    def __init__(self, pids):
        import threading
        import psutil
        self.procs = [psutil.Process(p) for p in pids]
        self.peak = [0] * len(self.procs)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.02):
            for i, p in enumerate(self.procs):
                try:
                    self.peak[i] = max(self.peak[i], p.memory_info().rss)
                except Exception:  # a worker gone
                    pass

    def stop(self):
        self.done.set()
        self.thread.join()
        return [round(b / 2**20) for b in self.peak]


def _spill_stats():
    """A worker's spill arena (datamem.stats()) and its resident set."""
    import datamem
    a = datamem.stats()["arenas"].get("spill", {})
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {k: a.get(k) for k in ("fallbacks", "backing_disk_bytes", "backing_resident_bytes",
                                  "backing_paged_out_bytes", "backing_full")} | {"rss": rss}


# ---- Ray --------------------------------------------------------------------------------------

def _meminfo():
    vals = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0]) * 1024
    return vals["MemTotal"], vals["MemTotal"] - vals["MemAvailable"]


def run_ray(mode):
    total, used = _meminfo()
    threshold = min(0.95, (used + (3 << 30)) / total)
    os.environ["RAY_memory_usage_threshold"] = "%.3f" % threshold
    os.environ["RAY_memory_monitor_refresh_ms"] = "100"
    import ray
    import datamem.ray

    out = {"mode": mode, "num_cpus": 2, "keep_tasks": N_KEEP,
           "runaway": "%d x %d MiB" % (RUNAWAY_BLOCKS, BLOCK >> 20),
           "memory_usage_threshold": round(threshold, 3),
           "node_used_at_start_GiB": round(used / 2**30, 2)}
    env = None
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "ray-tag-limit":
            path = os.path.join(tmp, "policy.yaml")
            with open(path, "w") as f:
                f.write(POLICY_TAG)
            env = datamem.ray.runtime_env(path)
            out["policy"] = POLICY_TAG
        ray.init(num_cpus=2, runtime_env=env, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
        try:
            keep_r = ray.remote(max_retries=3)(keep)
            run_r = ray.remote(max_retries=3)(runaway)
            kept = [keep_r.remote(i) for i in range(N_KEEP)]
            ray.wait(kept, num_returns=len(kept), timeout=120)
            t0 = time.monotonic()
            log = os.path.join(tmp, "attempts")
            bad = run_r.remote(log)
            try:
                out["runaway_outcome"] = {"ok": ray.get(bad, timeout=BOUND_S)}
            except Exception as e:
                out["runaway_outcome"] = _error(e)
            got = ray.get(kept, timeout=60)
            out["results"] = len(got)
            out["results_ok"] = all(float(a[0]) == float(i) for i, a in enumerate(got))
            out["wall_s"] = round(time.monotonic() - t0, 2)
            with open(log) as f:
                pids = f.read().split()
            out["runaway_attempts"] = len(pids)
            out["runaway_workers"] = len(set(pids))
        finally:
            ray.shutdown()
    return out


def main(argv):
    page = None
    if "--page" in argv:
        i = argv.index("--page")
        page = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    modes = [a for a in argv if not a.startswith("--")]
    if len(modes) == 1:  # the child: one mode, JSON on the last line
        mode = modes[0]
        res = run_ray(mode) if mode.startswith("ray") else run_dask(mode, page)
        print(json.dumps(res))
        return 0
    results = {}
    for mode in modes or MODES:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), mode],
                           capture_output=True, text=True, timeout=600)
        try:
            results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            results[mode] = {"mode": mode, "failed": r.returncode, "stderr": r.stderr[-2000:]}
        results[mode]["process_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(results[mode]), flush=True)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    doc = {"command": "python bench/cluster_runaway.py " + " ".join(modes), "results": results}
    if os.path.exists(OUT) and modes:
        with open(OUT) as f:
            old = json.load(f).get("results", {})
        old.update(results)
        doc["results"] = old
    with open(OUT + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(OUT + ".tmp", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
