"""A big array: Jacobi steps of a 5-point stencil over a 1 GiB grid, then a
random gather over it.

The grid (8192 x 16384 float64) is filled once (first touch), updated once
with slice arithmetic (each step makes ~1 GiB temporaries, as NumPy code
does), and 4M random elements are gathered: TLB reach (hugepages) and
first-touch cost dominate.
"""
import numpy as np


def run(scale=1.0):
    rows, cols = int(8192 * scale), 16384
    u = np.empty((rows, cols))
    u[:] = np.linspace(0.0, 1.0, cols)[None, :]
    u[0, :] = 1.0
    for _ in range(1):
        u[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
    rng = np.random.default_rng(15)
    idx = rng.integers(0, u.size, 1 << 22)
    flat = u.reshape(-1)
    s = 0.0
    for _ in range(2):
        s += float(flat.take(idx).sum())
    return s, {"thp_live_mb": anon_huge_mb()}


def anon_huge_mb():
    """AnonHugePages of the process while the grid is alive."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0
