"""A thread pool processing chunks: 2 workers, 32 chunks of 2M float64 (16 MiB).

Each chunk is generated, normalised, sorted, scanned (cumsum) and reduced in
a worker thread (NumPy releases the GIL in these loops); pool threads are
named "worker_N" (ThreadPoolExecutor(thread_name_prefix="worker")), which
configs/demo.yaml routes to its own arena.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def chunk(i, n):
    rng = np.random.default_rng(1000 + i)
    x = rng.standard_normal(n)
    x = (x - x.mean()) / x.std()
    y = np.sort(x)
    c = np.cumsum(y * y)
    q = np.quantile(x, [0.01, 0.5, 0.99])
    return float(c[-1] / n + q.sum())


def run(scale=1.0):
    n = 2 << 20
    nchunks = max(2, int(32 * scale))
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="worker") as pool:
        return sum(pool.map(chunk, range(nchunks), [n] * nchunks))
