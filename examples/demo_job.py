"""A job that knows nothing about datamem. Run it as

    DATAMEM_CONFIG=configs/demo.yaml python examples/demo_job.py

and every array below is allocated by datamem, in the arena the policy picks.
It prints, per array class, which arena served it, then per-arena stats.
"""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:  # NumPy 2.x
    from numpy._core.multiarray import get_handler_name
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import get_handler_name

rows = []


def record(what, where, arr):
    try:
        import datamem
        arena = datamem.arena_of(arr)
    except ImportError:
        arena = None
    handler = get_handler_name(arr)
    rows.append((what, where, arr.nbytes, handler, arena or "-"))


def main_thread_arrays():
    record("tiny float64[8]", "main thread", np.zeros(8))
    record("medium float64[100k]", "main thread", np.ones(100_000))
    record("big float32[4M] (16 MiB)", "main thread", np.empty(4 << 20, dtype=np.float32))


def worker_arrays():
    record("medium int64[50k]", threading.current_thread().name, np.arange(50_000))


async def ingest_task():
    try:
        import datamem
        tag = datamem.tag("ingest")
    except ImportError:
        import contextlib
        tag = contextlib.nullcontext()
    with tag:
        await asyncio.sleep(0)
        record("medium float64[20k]", "asyncio task, tag=ingest", np.random.rand(20_000))
    record("medium float64[20k]", "asyncio task, untagged", np.random.rand(20_000))


def main():
    main_thread_arrays()
    t = threading.Thread(target=worker_arrays, name="worker-1")
    t.start()
    t.join()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-pool") as pool:
        pool.submit(worker_arrays).result()
    asyncio.run(ingest_task())

    print("%-26s %-26s %10s  %-9s %s" % ("array", "where", "bytes", "handler", "arena"))
    for what, where, nbytes, handler, arena in rows:
        print("%-26s %-26s %10d  %-9s %s" % (what, where, nbytes, handler, arena))

    try:
        import datamem
    except ImportError:
        return
    if datamem.current_policy() is None:
        print("\n(datamem is not active: set DATAMEM_CONFIG)")
        return
    s = datamem.stats()
    print("\npolicy %s (hash %s)" % (s["policy_path"], s["policy_hash"]))
    print("%-10s %6s %8s %8s %14s %14s %14s" % ("arena", "align", "allocs", "frees",
                                                "requested", "allocated", "resident"))
    for name, a in s["arenas"].items():
        print("%-10s %6d %8d %8d %14d %14d %14d" % (
            name, a["alignment"], a["allocations"], a["frees"], a["bytes_requested"],
            a["allocated_bytes"], a["resident_bytes"]))


if __name__ == "__main__":
    main()
