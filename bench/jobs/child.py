"""One real job in this process: `python3 bench/jobs/child.py JOB [--scale S] [--expect CFG]`.

__main__.py (python3 -m bench.jobs) starts this once per (job, configuration)
with the configuration's environment. Prints one JSON object on stdout: wall and
CPU time of the job itself (imports excluded), minor faults during it, peak RSS
of the process (ru_maxrss: interpreter, libraries and job), AnonHugePages at the
end, the handler NumPy used, the allocator libraries mapped in (LD_PRELOAD check), the
datamem policy in force, and with datamem each arena's bytes at the end.
With --peak, also "peak": the largest resident set a sampler saw during the
job and, at that moment, what datamem's arenas held of it and pyarrow's pool
(PeakSampler; off by default, so it costs the timed runs nothing).
"""
import argparse
import importlib
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workloads import preloaded  # noqa: E402  one LD_PRELOAD check for both benchmarks

JOBS = ["pandas_etl", "pandas3_etl", "pandas3_arrow", "sklearn_pipeline", "scipy_cg", "fft_image",
        "stencil_big", "threadpool"]
# Jobs that are another job's module run another way (pandas3_etl.py says how).
MODULE = {"pandas3_arrow": "pandas3_etl"}
# Libraries each job needs, imported before the clock starts (import time and
# import-time allocations are the same for every configuration).
PRELOAD = {"pandas_etl": ["pandas"], "pandas3_etl": ["pandas"],
           "pandas3_arrow": ["pyarrow", "pandas"],
           "sklearn_pipeline": ["sklearn.cluster", "sklearn.decomposition"],
           "scipy_cg": ["scipy.sparse.linalg", "scipy.ndimage"]}
# Libraries a job runs without although they are installed: None in
# sys.modules makes their import fail, so pandas takes its no-pyarrow paths
# (its default string dtype stores Python objects in NumPy arrays).
HIDE = {"pandas3_etl": ["pyarrow"]}


def anon_huge_mb():
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def handler_name():
    import numpy as np
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import get_handler_name
    return get_handler_name(np.empty(1))


def blas():
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return [{k: i.get(k) for k in ("internal_api", "architecture", "num_threads")}
            for i in threadpool_info() if i.get("user_api") == "blas"]


def datamem_arenas():
    try:
        import datamem
    except ImportError:
        return None, None
    if not datamem.current_policy():
        return None, None
    s = datamem.stats()
    keys = ("active_bytes", "dirty_bytes", "muzzy_bytes", "retained_bytes", "resident_bytes",
            "mapped_bytes", "hugepage_bytes", "growth_purges")
    return datamem.current_policy(), {
        name: {k: a.get(k) for k in keys} for name, a in s["arenas"].items()
        if a.get("allocations") or a.get("mapped_bytes")} | {
        "_thread_cache_bytes": s.get("thread_cache_bytes")}


MIB = 1 << 20  # the peak's numbers are MiB, as maxrss_mb (ru_maxrss / 1024)


class PeakSampler(threading.Thread):
    """Reads the resident set (/proc/self/statm) every PERIOD_S while the job
    runs; when it is 1% above the largest seen, records a fresh datamem.stats()
    at that moment: the process's resident bytes, the arenas' (their
    resident_bytes summed) and pyarrow's pool. So the share of the job's peak
    RSS a policy can act on costs a statm read per period and a stats() call
    (~150 us) per new peak, in every configuration alike (without datamem only
    the statm read). Jobs release the GIL in NumPy, so the sampler runs while
    they compute; a peak between two samples is missed (ru_maxrss has it).
    The stats() calls add ~1-3% to a short job's time: python3 -m bench.jobs --shares
    runs it in repetitions of their own, never in the timed ones."""
    PERIOD_S = 0.02

    def __init__(self):
        super().__init__(name="peak-sampler", daemon=True)
        self.done = threading.Event()
        self.peak = None
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.page = os.sysconf("SC_PAGESIZE")

    def rss(self):
        return int(os.pread(self.fd, 128, 0).split()[1]) * self.page

    def sample(self):
        rss = self.rss()
        if self.peak is not None and rss <= self.peak["rss_mb"] * 1.01 * MIB:
            return
        p = {"rss_mb": rss / MIB, "arenas_mb": None, "pyarrow_mb": None}
        dm = sys.modules.get("datamem")
        if dm is not None and dm.current_policy():
            s = dm.stats()
            p["rss_mb"] = s["process_resident_bytes"] / MIB
            p["arenas_mb"] = sum(a["resident_bytes"] for a in s["arenas"].values()) / MIB
            if "pyarrow_allocated_bytes" in s:
                p["pyarrow_mb"] = s["pyarrow_allocated_bytes"] / MIB
        elif sys.modules.get("pyarrow") is not None:  # None: hidden (pandas3_etl)
            p["pyarrow_mb"] = sys.modules["pyarrow"].total_allocated_bytes() / MIB
        self.peak = p

    def run(self):
        while not self.done.wait(self.PERIOD_S):
            self.sample()

    def stop(self):
        self.done.set()
        self.join()
        self.sample()  # the end of the job can be its peak
        os.close(self.fd)
        return self.peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("job", choices=JOBS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--peak", action="store_true", help="sample the peak's composition")
    args = ap.parse_args()
    for mod in HIDE.get(args.job, []):
        sys.modules[mod] = None
    for mod in PRELOAD.get(args.job, []):
        importlib.import_module(mod)
    job = importlib.import_module(MODULE.get(args.job, args.job))
    if hasattr(job, "check"):
        job.check(args.job)
    sampler = PeakSampler() if args.peak else None
    if sampler:
        sampler.start()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    c0, t0 = time.process_time(), time.perf_counter()
    checksum = job.run(args.scale)
    extra = {}
    if isinstance(checksum, tuple):  # (checksum, {metric: value}) measured inside the job
        checksum, extra = checksum
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    peak = sampler.stop() if sampler else None
    policy, arenas = datamem_arenas()
    print(json.dumps({
        "job": args.job, "wall_s": wall, "cpu_s": cpu, "faults": ru.ru_minflt - r0.ru_minflt,
        "user_s": ru.ru_utime - r0.ru_utime, "sys_s": ru.ru_stime - r0.ru_stime,
        "maxrss_mb": ru.ru_maxrss / 1024, "rss_before_mb": r0.ru_maxrss / 1024,
        "thp_mb": anon_huge_mb(), "checksum": checksum, "handler": handler_name(),
        "preloaded": preloaded(), "policy": policy, "arenas": arenas, "blas": blas(),
        "extra": extra, "peak": peak,
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
                                              "OMP_NUM_THREADS")},
    }))


if __name__ == "__main__":
    main()
