"""Benchmark workloads, one per process: `python3 bench/workloads.py NAME [--quick]`.

Times are CPU time (time.thread_time; process_time for two threads), which
leaves out the time a process spends descheduled on a shared machine.

Prints one JSON object on stdout: {"workload", "handler", "results": {metric: value},
"maxrss_kb", "rss0_kb"}. bench/run.py starts this script once per (workload,
configuration) with the configuration's environment (LD_PRELOAD, MALLOC_CONF,
GLIBC_TUNABLES, DATAMEM_CONFIG) and collects medians over repetitions.

Workloads (docs/performance.md describes each):
  empty      np.empty create/destroy, ns/op, 64 B .. 64 MiB
  zeros      np.zeros create/destroy, ns/op, 64 B .. 64 MiB
  touch      np.zeros + write one byte in every page, us/op, 64 KiB .. 64 MiB
  temp1/8/64 d = a*b + c; e = np.sqrt(d) - a on 1/8/64 MiB float64, us/iter and
             minor page faults per iteration (getrusage ru_minflt)
  threads8/64  the same loop in two threads at once, us/iter (process CPU time
             per iteration of one thread)
  mixed      sizes log-uniform 64 B .. 64 MiB, random lifetimes (random
             replacement in a pool of 32 live arrays), every page of each new array
             written once; ns/op, minor faults/op, peak RSS (ru_maxrss) and peak
             live bytes
  gather     first-touch fill of a big float64 array (2 GiB, 256 MiB with
             --quick), then a random gather a[idx]; ms and ns/element
"""
import json
import os
import random
import resource
import statistics
import sys
import threading
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")
QUICK = "--quick" in sys.argv
CD_SIZES = [64, KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB]
TOUCH_SIZES = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]


# CPU time of the calling thread, not wall time: this VM has 2 cores shared with
# other jobs, and a process that is descheduled mid-batch would otherwise be
# charged for it. It includes the kernel's time in page faults and madvise.
# The two-thread workload uses the whole process's CPU time instead.
clock = time.thread_time


def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE // 1024


def preloaded():
    """Allocator libraries mapped into this process (checks LD_PRELOAD took)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            for lib in ("libjemalloc", "libtcmalloc", "libmimalloc"):
                if lib in path:
                    found.add(lib[3:])
    return sorted(found)


def cpu_reference_ns():
    """A pure-Python loop: how fast this process's CPU is right now (noise check)."""
    best = 1.0
    for _ in range(5):
        t0 = clock()
        for _ in range(20000):
            pass
        best = min(best, clock() - t0)
    return best / 20000 * 1e9


def handler_name():
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import get_handler_name
    return get_handler_name(np.empty(1))


def timed_batches(fn, n, batches):
    """Median over `batches` of the time per call of fn(n) (fn loops n times)."""
    out = []
    for _ in range(batches):
        t0 = clock()
        fn(n)
        out.append((clock() - t0) / n)
    return statistics.median(out)


def calibrate(fn, budget):
    """Loop count so that one batch takes about `budget` seconds."""
    n = 1
    while True:
        t0 = clock()
        fn(n)
        dt = clock() - t0
        if dt > budget / 4 or n >= 1 << 24:
            return max(1, int(n * budget / max(dt, 1e-9)))
        n *= 4


def best_interleaved(loops):
    """Per size, the best of several batches timed in a shuffled order each
    round, so that sizes share the machine's noise; the best batch, because
    interference from other processes only adds."""
    samples = {s: [] for s in loops}
    order = list(loops)
    for _ in range(5 if QUICK else 9):
        random.shuffle(order)
        for size in order:
            fn, n = loops[size]
            samples[size].append(timed_batches(fn, n, 1))
    return {s: min(v) for s, v in samples.items()}


def create_destroy(make):
    """Each size: best of 5 (9) batches, sizes interleaved in shuffled rounds."""
    budget = 0.02 if QUICK else 0.05
    res = {}
    loops = {}
    for size in CD_SIZES:
        def fn(n, size=size):
            for _ in range(n):
                make(size, np.uint8)
        fn(50)  # warm the caches of whatever allocator
        loops[size] = (fn, calibrate(fn, budget))
    best = best_interleaved(loops)
    for size in CD_SIZES:
        res["%s_ns" % fmt_size(size)] = best[size] * 1e9
    return res


def w_empty():
    return create_destroy(np.empty)


def w_zeros():
    return create_destroy(np.zeros)


def w_touch():
    budget = 0.03 if QUICK else 0.08
    loops = {}
    for size in TOUCH_SIZES:
        def fn(n, size=size):
            for _ in range(n):
                a = np.zeros(size, np.uint8)
                a[::PAGE] = 1
                del a
        fn(3)
        loops[size] = (fn, calibrate(fn, budget))
    best = best_interleaved(loops)
    return {"%s_us" % fmt_size(s): best[s] * 1e6 for s in TOUCH_SIZES}


def temporaries_loop(nbytes, iters):
    n = nbytes // 8
    rng = np.random.default_rng(1)
    a = rng.random(n) + 1.0
    b = rng.random(n)
    c = rng.random(n)

    def body(k):
        for _ in range(k):
            d = a * b + c
            e = np.sqrt(d) - a
            del d, e
    return body


def w_temp(mib):
    body = temporaries_loop(mib * MiB, 0)
    body(5)  # reach steady state (arena sizes, decay, caches)
    per = ({1: 0.02, 8: 0.08, 64: 0.25} if QUICK else {1: 0.05, 8: 0.2, 64: 0.8})[mib]
    n = calibrate(body, per)
    times, faults = [], []
    for _ in range(5 if QUICK else 9):
        f0 = minflt()
        t0 = clock()
        body(n)
        times.append((clock() - t0) / n)
        faults.append((minflt() - f0) / n)
    return {"us": statistics.median(times) * 1e6, "faults": statistics.median(faults)}


def w_threads(mib):
    bodies = [temporaries_loop(mib * MiB, 0) for _ in range(2)]
    iters = ({8: 40, 64: 5} if QUICK else {8: 180, 64: 24})[mib]

    steady = []  # faults of a thread's iterations after its first (RUSAGE_THREAD)

    def round_():
        barrier = threading.Barrier(3)

        def run(b):
            barrier.wait()
            b(1)  # a new thread's first allocations set up its state (2-13 faults)
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            b(iters - 1)
            steady.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
        ts = [threading.Thread(target=run, args=(b,)) for b in bodies]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.process_time()
        for t in ts:
            t.join()
        return (time.process_time() - t0) / iters / 2  # CPU per iteration of one thread

    round_()  # warm-up: both threads at once, as measured (arena growth, caches)
    del steady[:]
    times = []
    f0 = minflt()
    for _ in range(5 if QUICK else 7):
        times.append(round_())
    nit = 2 * iters * len(times)
    # faults: the whole process, thread starts included; steady_faults: only the
    # loops, each thread's first iteration left out.
    return {"us": statistics.median(times) * 1e6,
            "faults": (minflt() - f0) / nit,
            "steady_faults": sum(steady) / (len(steady) * (iters - 1))}


def w_mixed():
    rng = random.Random(7)
    lo, hi = 6, 26  # 64 B .. 64 MiB, log-uniform
    nslots = 32
    nops = 1000 if QUICK else 4000
    sizes = [int(2 ** rng.uniform(lo, hi)) for _ in range(nops + nslots)]
    slots = [rng.randrange(nslots) for _ in range(nops)]
    pool = []
    for size in sizes[:nslots]:  # fill the pool
        a = np.empty(size, np.uint8)
        a[::PAGE] = 1
        pool.append(a)
    live = peak_live = sum(a.nbytes for a in pool)
    f0 = minflt()
    t0 = clock()
    for size, slot in zip(sizes[nslots:], slots):
        a = np.empty(size, np.uint8)
        a[::PAGE] = 1
        live += size - pool[slot].nbytes
        pool[slot] = a
        if live > peak_live:
            peak_live = live
    dt = clock() - t0
    return {"ns": dt / nops * 1e9, "faults": (minflt() - f0) / nops,
            "peak_live_mb": peak_live / 1e6}


def w_gather():
    nbytes = (256 if QUICK else 2048) * MiB
    n = nbytes // 8
    t0 = clock()
    a = np.empty(n)
    a.fill(1.0)  # first touch
    fill_ms = (clock() - t0) * 1e3
    rng = np.random.default_rng(3)
    m = 1 << 22
    idx = rng.integers(0, n, m)
    a[idx].sum()
    times = []
    for _ in range(5 if QUICK else 9):
        t0 = clock()
        a.take(idx)
        times.append(clock() - t0)
    thp_kb = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    thp_kb = int(line.split()[1])
    except OSError:
        pass
    return {"fill_ms": fill_ms, "ns": statistics.median(times) / m * 1e9,
            "thp_mb": thp_kb / 1024}


def fmt_size(s):
    if s >= MiB:
        return "%dM" % (s // MiB)
    if s >= KiB:
        return "%dK" % (s // KiB)
    return "%dB" % s


WORKLOADS = {
    "empty": w_empty,
    "zeros": w_zeros,
    "touch": w_touch,
    "temp1": lambda: w_temp(1),
    "temp8": lambda: w_temp(8),
    "temp64": lambda: w_temp(64),
    "threads8": lambda: w_threads(8),
    "threads64": lambda: w_threads(64),
    "mixed": w_mixed,
    "gather": w_gather,
}


def main():
    name = sys.argv[1]
    random.seed(12345)
    rss0 = rss_kb()
    ref = cpu_reference_ns()
    res = WORKLOADS[name]()
    out = {
        "workload": name,
        "handler": handler_name(),
        "preloaded": preloaded(),
        "results": res,
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "rss0_kb": rss0,
        "ref_ns": ref,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
