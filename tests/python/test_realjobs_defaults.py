"""Defaults that keep real jobs as fast and as small as under NumPy's own allocator
(issue 12; docs/performance.md, "Real jobs"). Each case runs in a fresh
interpreter, since the policy and NumPy's hugepage setting are read at start-up.

What is pinned here is behaviour, not time: which memory is advised for
hugepages (the VmFlags of the mapping: `hg` is MADV_HUGEPAGE, `nh`
MADV_NOHUGEPAGE), and that np.zeros of a big reused block gives its pages back
instead of clearing them (RSS), with every byte still zero.
"""
import json
import os

import pytest

from conftest import CONFIGS, run_py
from test_arena_powers import fake_cudart  # noqa: F401  (fixture: a CUDA runtime stand-in)

MINIMAL = os.path.join(CONFIGS, "minimal.yaml")

# Prints the VmFlags of the mapping that holds the middle of a fresh 64 MiB array
# and of a 1 MiB one, plus the arena that served them.
VMFLAGS = r"""
import json, sys
import numpy as np
import datamem
PRE = r'''%s'''
exec(PRE)

def vmflags(addr):
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = lo <= addr < hi
            elif cur and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None

big = np.empty(64 << 20, np.uint8)
big[::4096] = 1
small = np.empty(1 << 20, np.uint8)
print(json.dumps({"arena": datamem.arena_of(big),
                  "big": vmflags(big.ctypes.data + big.nbytes // 2)}))
"""


def flags(pre="", config=MINIMAL, env=None):
    r = run_py(VMFLAGS % pre, config=config, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["arena"] is not None, "datamem did not serve the array"
    return out


def test_system_arena_advises_big_blocks_like_numpy():
    """minimal.yaml (hugepages: system) advises a 64 MiB block MADV_HUGEPAGE, as
    NumPy's default handler advises every array >= 4 MiB."""
    out = flags()
    assert "hg" in out["big"], out


def test_numpy_madvise_hugepage_0_is_honoured():
    out = flags(env={"NUMPY_MADVISE_HUGEPAGE": "0"})
    assert "hg" not in out["big"], out


def test_set_madvise_hugepage_false_is_honoured():
    """NumPy's switch, turned off before datamem installs: no advice."""
    pre = ("m = getattr(getattr(np, '_core', None), 'multiarray', None) or np.core.multiarray\n"
           "m._set_madvise_hugepage(False)\n"
           "datamem.install(%r)\n" % MINIMAL)
    out = flags(pre=pre, config=None)
    assert "hg" not in out["big"], out


def test_hugepages_off_still_forbids(write_policy):
    path = write_policy("version: 1\ndefault: main\narenas:\n  main: {hugepages: off}\n")
    out = flags(config=path)
    assert "nh" in out["big"] and "hg" not in out["big"], out


ZEROS = r"""
import json
import numpy as np

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

N = %d
a = np.empty(N, np.uint8)
a.fill(7)                      # every page resident and dirty
addr = a.ctypes.data
del a                          # the block stays in the arena (decay keeps it)
before = rss()
z = np.zeros(N, np.uint8)
after = rss()
print(json.dumps({"reused": z.ctypes.data == addr, "before": before, "after": after,
                  "nonzero": int(np.count_nonzero(z))}))
"""


def zeros(n):
    r = run_py(ZEROS % n, config=MINIMAL)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", [(64 << 20), (64 << 20) + 123, (32 << 20) + 4096 + 17])
def test_zeros_of_reused_big_block_gives_pages_back(n):
    """np.zeros of a reused block >= 32 MiB does not memset it: its pages go back
    to the kernel (RSS drops by the block) and read as zeros, ends included."""
    out = zeros(n)
    assert out["nonzero"] == 0, out
    assert out["before"] - out["after"] >= n - (4 << 20), out


def test_zeros_below_32mib_clears_in_place():
    """Below 32 MiB a reused block is cleared with memset (as glibc clears reused
    heap memory for NumPy's default): the pages stay, and read as zeros."""
    out = zeros(16 << 20)
    assert out["nonzero"] == 0, out
    assert abs(out["before"] - out["after"]) < (4 << 20), out


GROWING = r"""
import json, resource
import numpy as np
import datamem

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

start = rss()
peak = 0
for mib in range(8, 44, 4):          # 8, 12, ... 40 MiB: each too big for the last hole
    a = np.empty(mib << 20, np.uint8)
    a[::4096] = 1
    peak = max(peak, rss() - start)
    del a
st = datamem.stats()["arenas"]["main"]
print(json.dumps({"peak": peak, "purges": st["growth_purges"]}))
"""


def test_default_budget_bounds_dirty_pages(write_policy):
    """A policy that leaves decay at its defaults purges on growth (decay.budget 0):
    arrays of growing sizes (216 MiB in all, 40 MiB at most) keep the resident set
    near the largest one instead of the sum, as NumPy's default would. With
    `budget: never` (the old default) every freed block stays resident."""
    r = run_py(GROWING, config=MINIMAL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["purges"] > 0, out
    assert out["peak"] < (100 << 20), out
    never = write_policy("version: 1\ndefault: main\narenas:\n  main: {decay: {budget: never}}\n")
    r = run_py(GROWING, config=never)
    assert r.returncode == 0, r.stderr
    kept = json.loads(r.stdout.strip().splitlines()[-1])
    assert kept["purges"] == 0 and kept["peak"] > (160 << 20), kept


def test_zeros_in_a_pinned_arena_keeps_its_pages(write_policy, fake_cudart):
    """Memory registered with the CUDA runtime must keep its pages: np.zeros of a
    reused big block there is cleared with memset, never given back."""
    pol = write_policy("version: 1\ndefault: gpu\narenas:\n  gpu: {pinned: cuda}\n")
    r = run_py(ZEROS % (64 << 20), config=pol, env={"DATAMEM_CUDART": fake_cudart})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["nonzero"] == 0, out
    assert out["before"] - out["after"] < (4 << 20), out
