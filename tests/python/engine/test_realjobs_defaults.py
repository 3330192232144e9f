"""Defaults that keep real jobs as fast and as small as under NumPy's own allocator
(docs/performance.md, "Real jobs"). Each case runs in a fresh
interpreter, since the policy and NumPy's hugepage setting are read at start-up.

What is pinned here is behaviour, not time: which memory is advised for
hugepages (the VmFlags of the mapping: `hg` is MADV_HUGEPAGE, `nh`
MADV_NOHUGEPAGE), and that np.zeros of a big reused block gives its pages back
instead of clearing them (RSS), with every byte still zero.
"""
import os

import pytest

from conftest import CONFIGS, UNDER_ASAN, UNDER_TSAN, last_json, run_py, skip_under_asan

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
    out = last_json(r)
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


ALIGNED = r"""
import json
import numpy as np
keep, big = [], []
for n in [5 << 20, 23_000_000, 4_198_400, 48_000_000, 7 << 20, 23_000_000]:
    keep.append(np.empty(3000, np.uint8))  # small blocks in between
    big.append(np.empty(n, np.uint8))
print(json.dumps([a.ctypes.data % (2 << 20) for a in big]))
"""


@pytest.mark.parametrize("thp", ["1", "0"])
def test_big_blocks_start_on_a_hugepage_frame(thp):
    """A block >= 4 MiB from a big half starts on a 2 MiB boundary, so every
    whole frame of it can be a hugepage: page-aligned, a 23 MB array lost up to
    two frames to 4 KiB pages at its ends (pandas_etl took 39.6k faults, 29.6k
    aligned; docs/performance.md). The array starts at the block's colour, under
    4 KiB in steps of 64 bytes (design.md, "The colour of big blocks"), which
    varies from block to block; none for an exact size class (5 and 7 MiB).
    Without NumPy's advice the blocks are placed the same (free finds a block by
    its frame), only not advised (test_numpy_madvise_hugepage_0_is_honoured)."""
    r = run_py(ALIGNED, config=MINIMAL, env={"NUMPY_MADVISE_HUGEPAGE": thp})
    offsets = last_json(r)
    assert all(o < 4096 and o % 64 == 0 for o in offsets), offsets
    assert offsets[0] == offsets[4] == 0, offsets
    assert len({offsets[i] for i in (1, 2, 3, 5)}) > 1, offsets


ZEROS = r"""
import json, resource
import numpy as np

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

N, PART = %d, %r
a = np.empty(N, np.uint8)
a[: int(N * PART)].fill(7)     # that share of the pages resident and dirty
addr = a.ctypes.data
del a                          # the block stays in the arena (decay keeps it)
before = rss()
z = np.zeros(N, np.uint8)
after = rss()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
z[::4096] = 1                  # the job uses every page
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
z[::4096] = 0
print(json.dumps({"reused": z.ctypes.data == addr, "before": before, "after": after,
                  "nonzero": int(np.count_nonzero(z)), "faults": faults}))
"""


def zeros(n, part=1.0):
    r = run_py(ZEROS % (n, part), config=MINIMAL)
    out = last_json(r)
    assert out["reused"], out
    return out


@pytest.mark.parametrize("n", [(64 << 20), (64 << 20) + 123, (32 << 20) + 4096 + 17])
def test_zeros_of_a_partly_used_big_block_gives_pages_back(n):
    """np.zeros of a reused block >= 32 MiB whose pages are not all resident does
    not memset it: its pages go back to the kernel (RSS drops by what was
    resident) and read as zeros, ends included. np.zeros(64 MiB) left unused
    costs a system call, not a 64 MiB memset (the issue's 561x)."""
    out = zeros(n, 0.5)
    assert out["nonzero"] == 0, out
    assert out["before"] - out["after"] >= n // 2 - (4 << 20), out


@pytest.mark.parametrize("n", [(64 << 20), (32 << 20) + 4096 + 17])
def test_zeros_of_a_fully_used_big_block_clears_it_in_place(n):
    """Every page resident (the last array used them all): clearing in place
    costs what the kernel's zero-fill would and saves the faults and the
    freeing and re-allocating of the pages (np.zeros + touch at 64 MiB: 0.19x
    the default, 1.11x when the block is given back and refaulted;
    docs/performance.md). RSS stays, zeros read."""
    out = zeros(n, 1.0)
    assert out["nonzero"] == 0, out
    assert abs(out["before"] - out["after"]) < (4 << 20), out
    assert out["faults"] < 64, out


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
    `budget: never` (the old default) every freed block stays resident. (At
    `hugepages: off`, which has no big half and so no lending: lending alone
    bounds this loop, the test below.)"""
    purged = write_policy("version: 1\ndefault: main\narenas:\n  main: {hugepages: off}\n")
    r = run_py(GROWING, config=purged)
    out = last_json(r)
    assert out["purges"] > 0, out
    assert out["peak"] < (100 << 20), out
    never = write_policy("version: 1\ndefault: main\narenas:\n"
                         "  main: {hugepages: off, decay: {budget: never}}\n")
    r = run_py(GROWING, config=never)
    kept = last_json(r)
    assert kept["purges"] == 0 and kept["peak"] > (160 << 20), kept


def test_lending_bounds_growing_sizes_without_a_purge(write_policy):
    """Each freed block lends its frames to the next, bigger one (runtime/bigblock.c,
    "Lending"): with no purge at all (`budget: never`) the resident set stays near
    the largest array, where it held every freed block (over 160 MiB) before."""
    never = write_policy("version: 1\ndefault: main\narenas:\n  main: {decay: {budget: never}}\n")
    r = run_py(GROWING, config=never)
    out = last_json(r)
    assert out["purges"] == 0 and out["peak"] < (100 << 20), out
    r = run_py(GROWING, config=MINIMAL)
    out = last_json(r)
    assert out["peak"] < (100 << 20), out


SLACK = r"""
import json
import numpy as np
import datamem

ballast = np.empty(640 << 20, np.uint8)      # 640 MiB active, never touched
a = np.empty(24 << 20, np.uint8); a[::4096] = 1
del a                                         # 24 MiB dirty: above 1/64 of active, below 1/16
before = datamem.stats()["arenas"]["main"]["growth_purges"]
b = np.empty(32 << 20, np.uint8)             # does not fit the hole: the arena grows
st = datamem.stats()["arenas"]["main"]
print(json.dumps({"purges": st["growth_purges"] - before, "dirty": st["dirty_bytes"]}))
"""


def test_growth_purge_slack_is_small():
    """The growth purge leaves the arena at most 1/64 of its active bytes dirty.
    With 1/16 a job with ~450 MB live keeps 28 MB of freed pages at its peak:
    sklearn_pipeline 1.05x NumPy's default peak RSS."""
    r = run_py(SLACK, config=MINIMAL)
    out = last_json(r)
    assert out["purges"] == 1 and out["dirty"] < (10 << 20), out


HOLES = r"""
import json
import numpy as np
import datamem

MiB = 1 << 20
def touched(n):
    a = np.empty(n, np.uint8)
    a[::4096] = 1
    return a

def arena():
    return datamem.stats()["arenas"]["main"]

old = touched(7 * MiB // 2)                   # freed first: the oldest dirty pages
live = [touched(MiB)]
new = []
for _ in range(4):
    new.append(touched(3 * MiB))              # freed last
    live.append(touched(MiB))                 # keeps the holes apart
del old
new.clear()                                   # 15.5 MiB dirty in five holes
before = arena()
b = touched(15 * MiB // 4)                    # fits no hole: the arena grows past its peak
after = arena()
print(json.dumps({"purges": after["growth_purges"] - before["growth_purges"],
                  "dirty_before": before["dirty_bytes"], "dirty": after["dirty_bytes"]}))
"""


def test_a_growth_purge_gives_back_only_what_passed_the_peak():
    """Growth past the peak by 3.75 MiB with 15.5 MiB of freed pages in five
    holes: the purge gives back the oldest holes until the overshoot is covered
    (whole extents: the 3.5 MiB and one 3 MiB) and keeps the three newest for
    the next arrays, where a purge of every dirty page made them fault in
    again (scipy_cg: 15 MB given back for a 4 KiB overshoot)."""
    r = run_py(HOLES, config=MINIMAL)
    out = last_json(r)
    MiB = 1 << 20
    assert out["purges"] == 1 and out["dirty_before"] >= 15 * MiB, out
    assert 6 * MiB <= out["dirty"] <= out["dirty_before"] - 15 * MiB // 4, out


# HOLES after the process peaked higher outside datamem: 64 MiB mapped,
# touched and unmapped (mmap itself, not a Python object: the free-threaded
# build's mimalloc keeps a freed 64 MiB resident), so the resident set falls
# and its peak, VmHWM, stays.
HOLES_BELOW_PEAK = HOLES.replace("old = touched(", """import mmap
ballast = mmap.mmap(-1, 64 * MiB)
for i in range(0, 64 * MiB, 4096):
    ballast[i] = 1
ballast.close()
old = touched(""", 1)


def test_a_growth_below_the_process_peak_purges_nothing():
    """The purge on growth holds the process's peak RSS: a growth past
    datamem's own peak that leaves the process a sixteenth or more under the
    peak it already had gives nothing back, and the freed pages serve the next
    arrays (the pandas jobs: their arrays grow while pandas' and Arrow's
    buffers are freed, and each purge there was faulted in again)."""
    assert "ballast" in HOLES_BELOW_PEAK
    r = run_py(HOLES_BELOW_PEAK, config=MINIMAL)
    out = last_json(r)
    MiB = 1 << 20
    assert out["purges"] == 0 and out["dirty_before"] >= 15 * MiB, out
    assert out["dirty"] >= out["dirty_before"] - MiB // 2, out


# HOLES_BELOW_PEAK, then the process back at its peak (64 MiB mapped and
# touched again, kept) and one more growth that fits no hole.
BACK_AT_PEAK = HOLES_BELOW_PEAK.replace("print(json.dumps({", """again = mmap.mmap(-1, 64 * MiB)
for i in range(0, 64 * MiB, 4096):
    again[i] = 1
c = touched(15 * MiB // 4)
last = arena()
print(json.dumps({"purges_at_peak": last["growth_purges"] - after["growth_purges"],
                  "dirty_at_peak": last["dirty_bytes"], """, 1)


def test_a_growth_below_the_process_peak_is_not_given_back_later():
    """What a growth under the process's peak kept stays once the process is
    back at its peak: the next growth there gives back only what it passed
    datamem's mark by (its own 3.75 MiB: the 3.5 MiB and one 3 MiB hole, 9
    MiB stay), not the earlier growth's too (three holes, 6 MiB staying).
    Given back in one piece, pandas3_etl's count turned on a transient rise
    outside datamem that differs from run to run: 1.086x the default's pages
    against 1.041x (bench/results/mark-rises.md)."""
    assert "again" in BACK_AT_PEAK
    r = run_py(BACK_AT_PEAK, config=MINIMAL)
    out = last_json(r)
    MiB = 1 << 20
    assert out["purges"] == 0 and out["dirty"] >= 15 * MiB, out
    assert out["purges_at_peak"] == 1, out
    assert 8 * MiB <= out["dirty_at_peak"] <= out["dirty"] - 15 * MiB // 4, out


GLIBC_HOLE = r"""
import ctypes, json
import numpy as np
import datamem

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

# A mapped block freed: glibc's mmap threshold rises to its size (only up to
# 32 MiB with the chunk's header: a 32 MiB block leaves it where it is).
libc.free(libc.malloc(16 << 20))
chunks = [libc.malloc(1 << 20) for _ in range(64)]   # so these come from its heap
for c in chunks:
    ctypes.memset(c, 1, 1 << 20)
for c in chunks[:-1]:
    libc.free(c)                    # 63 MiB free inside glibc's heap, under a live chunk
before = rss()
a = np.ones(64 << 17)               # 64 MiB: datamem's footprint passes its peak
print(json.dumps({"grew": rss() - before}))
"""


@skip_under_asan  # ASan's malloc, not glibc's, serves ctypes' malloc there
def test_growth_past_the_peak_trims_glibc():
    """With NumPy's arrays in datamem's arenas, memory the rest of the process
    frees (pandas' hash tables, Python objects) stays in glibc's heap, where
    NumPy's default would have put the next arrays. When datamem's footprint
    passes its peak, glibc gives its free pages back (without that, pandas_etl's
    peak held 17 MiB of them, 1.020x NumPy's default peak RSS; with it, 1.002x)."""
    r = run_py(GLIBC_HOLE, config=MINIMAL)
    out = last_json(r)
    assert out["grew"] < (32 << 20), out      # the array's 64 MiB, less glibc's 63 MiB


@skip_under_asan  # ASan's malloc, not glibc's, serves ctypes' malloc there
def test_growth_below_the_process_peak_leaves_glibc_its_pages():
    """The same growth after the process peaked at 256 MiB more (mapped,
    touched, unmapped): glibc keeps its free pages, which the rest of the job
    would fault in again if they went (pandas3_arrow at scale 0.3: 119.4k
    pages against 122.4k, bench/results/process-peak.md)."""
    script = GLIBC_HOLE.replace("libc.free(libc.malloc(16 << 20))", """big = libc.malloc(256 << 20)
ctypes.memset(big, 1, 256 << 20)
libc.free(big)
libc.free(libc.malloc(16 << 20))""", 1)
    assert "256 << 20" in script
    r = run_py(script, config=MINIMAL)
    out = last_json(r)
    assert out["grew"] > (56 << 20), out      # the array's 64 MiB, glibc's 63 MiB kept


def test_zeros_in_a_pinned_arena_keeps_its_pages(write_policy, fake_cudart):
    """Memory registered with the CUDA runtime must keep its pages: np.zeros of a
    reused big block there is cleared with memset, never given back."""
    pol = write_policy("version: 1\ndefault: gpu\narenas:\n  gpu: {pinned: cuda}\n")
    r = run_py(ZEROS % ((64 << 20), 0.5), config=pol, env={"DATAMEM_CUDART": fake_cudart})
    out = last_json(r)
    assert out["nonzero"] == 0, out
    assert out["before"] - out["after"] < (4 << 20), out


# ---- reuse of freed big blocks (runtime/bigblock.c, "Reuse") ----------------

TWO_THREADS = r"""
import json, resource, threading
import numpy as np
import datamem

R = resource.RUSAGE_THREAD
out = {"faults": [], "je": []}

def stats():
    return datamem.stats()["arenas"]["main"]

def loop(seed):
    rng = np.random.default_rng(seed)
    a, b, c = (rng.random(2 << 20) + 1.0 for _ in range(3))   # 16 MiB each
    d = a * b + c; e = np.sqrt(d) - a; del d, e   # warm: the loop's code paths,
    warm = [a * b for _ in range(4)]       # and 4 temporaries per thread live at
    barrier.wait()                         # once, at least the loop's most (3 when
    del warm                               # NumPy cannot elide temporaries, as
    barrier.wait()                         # under ASan)
    f0 = resource.getrusage(R).ru_minflt
    for _ in range(40):
        d = a * b + c; e = np.sqrt(d) - a; del d, e
    out["faults"].append(resource.getrusage(R).ru_minflt - f0)
    barrier.wait()

barrier = threading.Barrier(3)
ts = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
[t.start() for t in ts]
barrier.wait(); barrier.wait(); je0 = stats()["jemalloc_allocations"]
barrier.wait(); je1 = stats()["jemalloc_allocations"]
[t.join() for t in ts]
print(json.dumps({"faults": out["faults"], "je_allocs": je1 - je0,
                  "reuse": stats()["reuse_bytes"]}))
"""


def test_big_temporaries_in_two_threads_reuse_their_blocks():
    """The temporaries of `a * b + c` at 16 MiB in two threads: after a warm-up,
    80 iterations take their blocks back from the arena's kept blocks, with no
    jemalloc call and no block refaulted (jemalloc's time decay alone purges one
    block now and then: 2.5-34 faults per iteration at 64 MiB, 100 and more over
    40 iterations; a refaulted 16 MiB block is 4096). A stray fault or two per
    thread is not a block: Python's and NumPy's own small allocations can touch
    a new page (one thread faulted once in a fresh-clone CI run on NumPy 1.26)."""
    r = run_py(TWO_THREADS, config=MINIMAL)
    out = last_json(r)
    assert len(out["faults"]) == 2 and max(out["faults"]) <= 4, out
    # Small allocations (Python's own) still reach jemalloc; no 16 MiB one does.
    assert out["je_allocs"] < 40, out
    assert out["reuse"] >= (16 << 20), out


REUSE = r"""
import json, time
import numpy as np
import datamem

def st():
    s = datamem.stats()
    a = s["arenas"]["main"]
    return dict({k: a[k] for k in ("reuse_bytes", "dirty_bytes", "active_bytes", "lent_bytes")},
                lend_frames=s["lend_frames"], lend_frames_max=s["lend_frames_max"])

res = {}
x = np.ones(16 << 20, np.uint8); addr = x.ctypes.data
del x
res["kept"] = st()
y = np.zeros(16 << 20, np.uint8)                 # the kept block, cleared
res["same"] = y.ctypes.data == addr
res["zero16"] = int(np.count_nonzero(y))
z = np.ones(64 << 20, np.uint8); del z
z = np.zeros(64 << 20, np.uint8)                  # kept, cleared by giving pages back
res["zero64"] = int(np.count_nonzero(z))
del y, z
res["two_kept"] = st()["reuse_bytes"]
w = np.empty(24 << 20, np.uint8)                  # no kept block of this size
res["after_miss"] = st()
del w
time.sleep(%s)
res["after_wait"] = st()
print(json.dumps(res))
"""


def run_reuse(config, wait=0.0):
    r = run_py(REUSE % wait, config=config)
    return last_json(r)


def test_kept_big_block_comes_back_zeroed_and_lends_on_a_miss():
    out = run_reuse(MINIMAL)
    assert out["kept"]["reuse_bytes"] == 16 << 20, out
    assert out["same"], out
    assert out["zero16"] == 0 and out["zero64"] == 0, out
    assert out["two_kept"] == (16 << 20) + (64 << 20), out
    # A 24 MiB request finds no block of its class: the kept blocks lend it their
    # frames, oldest first (bigblock.c, "Lending"): the 16 MiB one all of its 8
    # and goes back to jemalloc, the 64 MiB one 4 or 5 more (the new block's last
    # frame, where its colour reaches into it) and stays kept with the rest.
    assert (54 << 20) <= out["after_miss"]["reuse_bytes"] <= (56 << 20), out
    # stats say so: what was lent and what stays kept add up to the two blocks,
    # and every lent frame is counted against lending's cap
    lent = out["after_miss"]["lent_bytes"] - out["kept"]["lent_bytes"]
    assert lent + out["after_miss"]["reuse_bytes"] == (16 << 20) + (64 << 20), out
    frames = out["after_miss"]["lend_frames"] - out["kept"]["lend_frames"]
    assert frames == lent >> 21 and out["after_miss"]["lend_frames_max"] == 8192, out


def test_blocks_grown_by_realloc_are_reused():
    """pandas' hash tables grow their vectors by ndarray.resize (realloc). Under
    a one-arena policy a block grown past 4 MiB stayed in the arena's small
    half, and its free was kept there for 10 s (decay.dirty), where no
    allocation ever looks, while the next big arrays took fresh memory: eight
    rounds of 24 MB held 226 MB (a pandas 3 job ran at 1.10x-1.17x NumPy's
    default peak RSS). Now the grown block moves to the big half and its free
    serves the next big array."""
    r = run_py(r"""
import json
import numpy as np
import datamem
for i in range(8):
    a = np.ones(1000)
    a.resize(3_000_000 + 1000 * i, refcheck=False)   # realloc: 8 KB -> 24 MB
    a[:] = 1.0
    del a
    b = np.ones(3_000_000)
    del b
m = datamem.stats()["arenas"]["main"]
print(json.dumps({k: m[k] for k in ("active_bytes", "reuse_bytes", "reallocs")}))
""", config=MINIMAL)
    out = last_json(r)
    assert out["reallocs"] >= 8, out
    assert out["active_bytes"] < (64 << 20), out   # one or two 24 MB blocks, not eight


def test_kept_big_block_waits_at_most_decay_dirty(write_policy):
    quick = write_policy("version: 1\ndefault: main\narenas:\n"
                         "  main: {decay: {dirty: 200ms}}\n")
    out = run_reuse(quick, wait=0.6)
    assert out["after_wait"]["reuse_bytes"] == 0, out   # all kept, expired at the snapshot
    nothing = write_policy("version: 1\ndefault: main\narenas:\n  main: {decay: {dirty: 0ms}}\n")
    out = run_reuse(nothing)
    assert out["kept"]["reuse_bytes"] == 0 and out["two_kept"] == 0, out


def test_arena_with_a_limit_keeps_no_block(write_policy):
    limited = write_policy("version: 1\ndefault: main\narenas:\n  main: {limit: 2GiB}\n")
    r = run_py(r"""
import json
import numpy as np
import datamem
x = np.ones(16 << 20, np.uint8); del x
a = datamem.stats()["arenas"]["main"]
print(json.dumps({"reuse": a["reuse_bytes"], "live": a["live_bytes"]}))
""", config=limited)
    out = last_json(r)
    assert out["reuse"] == 0 and out["live"] < (1 << 20), out


def test_fork_with_kept_blocks_and_a_busy_thread():
    """fork() while another thread keeps and takes big blocks: the child can
    allocate and free big blocks (the reuse locks are taken around fork)."""
    r = run_py(r"""
import os, threading
import numpy as np
stop = False
def churn():
    while not stop:
        x = np.empty(8 << 20, np.uint8); del x
t = threading.Thread(target=churn); t.start()
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        for _ in range(5):
            y = np.ones(8 << 20, np.uint8); del y
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
stop = True; t.join()
print("ok")
""", config=MINIMAL, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_reload_applies_to_kept_blocks(write_policy):
    """A reload that gives the arena a limit (live bytes counted from then on) or
    a shorter decay hands its kept big blocks back at once."""
    limited = write_policy("version: 1\ndefault: main\narenas:\n  main: {limit: 4GiB}\n")
    r = run_py(r"""
import json, sys
import numpy as np
import datamem
x = np.ones(16 << 20, np.uint8); del x
before = datamem.stats()["arenas"]["main"]["reuse_bytes"]
datamem.reload(sys.argv[1])
a = datamem.stats()["arenas"]["main"]
y = np.ones(16 << 20, np.uint8)
live = datamem.stats()["arenas"]["main"]["live_bytes"]
del y
print(json.dumps({"before": before, "after": a["reuse_bytes"], "live": live,
                  "end": datamem.stats()["arenas"]["main"]["reuse_bytes"]}))
""".replace("sys.argv[1]", repr(limited)), config=MINIMAL)
    out = last_json(r)
    assert out["before"] == 16 << 20 and out["after"] == 0 and out["end"] == 0, out
    assert out["live"] >= 16 << 20, out


def test_growth_below_the_peak_footprint_keeps_dirty_pages(write_policy):
    """A purge only lowers peak RSS when datamem's footprint passes its highest so
    far: growth below that leaves the dirty pages to decay (the mixed benchmark
    ran 3x faster for it, with the same peak RSS), and growth past it gives
    back what passed it. At `hugepages: off`: no big half, so no lending, whose
    moves would serve the growth from the holes."""
    two = write_policy("version: 1\ndefault: b\narenas:\n  a: {decay: {dirty: 0ms}, hugepages: off}\n"
                       "  b: {hugepages: off}\n"
                       "rules:\n  - {name: huge, match: {size: {min: 256MiB}}, arena: a}\n")
    r = run_py(r"""
import json
import numpy as np
import datamem

def b():
    return datamem.stats()["arenas"]["b"]

c = np.empty(512 << 20, np.uint8); del c       # the peak: 512 MiB, gone at once (decay 0)
blocks = [np.ones(32 << 20, np.uint8) for _ in range(8)]
del blocks[::2]                                  # 128 MiB freed in 32 MiB holes
g = np.ones(48 << 20, np.uint8)                  # fits no hole: grows, still below the peak
below = b()
h = np.ones(250 << 20, np.uint8)                 # past the peak (still arena b)
above = b()
print(json.dumps({"below": [below["growth_purges"], below["dirty_bytes"]],
                  "above": [above["growth_purges"], above["dirty_bytes"]]}))
""", config=two)
    out = last_json(r)
    assert out["below"][0] == 0 and out["below"][1] >= (128 << 20), out
    # 554 MiB against the peak's 512: the 42 MiB over it go, in whole holes
    # (two of 32 MiB), and the other two stay for the next arrays
    assert out["above"][0] == 1 and (32 << 20) <= out["above"][1] <= (86 << 20), out


def test_a_growth_purge_never_lowers_the_peak_mark(write_policy):
    """After a purge, datamem's high-water footprint stays where it was, though
    the purge gave back more than the growth passed it by (jemalloc purges
    whole extents): later growth below the real peak purges nothing (the mixed
    benchmark: 59 purges with the mark lowered to what was left, 38 with it
    kept; the same peak RSS). At `hugepages: off`, as above."""
    one = write_policy("version: 1\ndefault: b\narenas:\n  b: {hugepages: off}\n")
    r = run_py(r"""
import json
import numpy as np
import datamem

def purges():
    return datamem.stats()["arenas"]["b"]["growth_purges"]

blocks = [np.ones(m << 20, np.uint8) for m in (64, 8, 60, 8, 32, 8)]  # the peak: 180 MiB
del blocks[0]                                    # the oldest hole, 64 MiB
del blocks[1]                                    # then 60 MiB
g = np.ones(66 << 20, np.uint8)                  # fits no hole: 246 MiB, 66 over the peak,
first = purges()                                 # and both holes go (124 MiB, whole extents)
del blocks[2]                                    # 32 MiB dirty: 122 MiB with g
h = np.ones(40 << 20, np.uint8)                  # grows to 162 MiB: below the peak
print(json.dumps({"first": first, "second": purges(),
                  "dirty": datamem.stats()["arenas"]["b"]["dirty_bytes"]}))
""", config=one)
    out = last_json(r)
    assert out["first"] == 1 and out["second"] == 1, out
    assert out["dirty"] >= (32 << 20), out      # the last hole, not purged


# Frees a 16 MiB array, then asks glibc for 12 MiB: prints whether glibc mapped
# it (above its mmap threshold) or served it from its heap. Under NumPy's
# default allocator the array's free raised glibc's threshold to 16 MiB (and
# its trim threshold to twice that), so the process's other mallocs of those
# sizes (pandas' hash tables) reuse the heap instead of fresh, zeroed mappings.
GLIBC_THRESHOLD = r"""
import ctypes
import numpy as np
libc = ctypes.CDLL("libc.so.6")
class MallInfo(ctypes.Structure):  # struct mallinfo: int fields, glibc 2.31 and later
    _fields_ = [(n, ctypes.c_int) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                          "usmblks", "fsmblks", "uordblks", "fordblks",
                                          "keepcost")]
libc.mallinfo.restype = MallInfo
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
a = np.ones(16 << 20, np.uint8)
del a
before = libc.mallinfo().hblks
p = libc.malloc(12 << 20)
print("mapped" if libc.mallinfo().hblks > before else "heap")
libc.free(p)
"""


def test_glibc_thresholds_move_as_under_numpys_default():
    """Fails if glibc never hears of NumPy's frees under a policy (runtime/libcheap.c):
    its mmap threshold stays at 128 KiB and the 12 MiB malloc is mapped."""
    seen = {}
    for name, config in (("default", None), ("minimal", MINIMAL)):
        r = run_py(GLIBC_THRESHOLD, config)
        assert r.returncode == 0, r.stderr
        seen[name] = r.stdout.strip()
    assert seen["minimal"] == "heap", seen  # glibc was shown the 16 MiB free
    if not (UNDER_ASAN or UNDER_TSAN):
        # as under NumPy's default, where glibc's malloc is NumPy's (under a
        # sanitizer NumPy's malloc is the sanitizer's, and glibc hears nothing)
        assert seen["default"] == "heap", seen


def test_a_glibc_threshold_the_user_set_is_kept():
    """GLIBC_TUNABLES' mmap_threshold turns glibc's dynamic threshold off: under a
    policy, as without one, the user's 128 KiB stays and 12 MiB is mapped."""
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}
    seen = {name: run_py(GLIBC_THRESHOLD, config, env=tunables)
            for name, config in (("default", None), ("minimal", MINIMAL))}
    for name, r in seen.items():
        assert r.returncode == 0, (name, r.stderr)
    got = {name: r.stdout.strip() for name, r in seen.items()}
    assert got["minimal"] == got["default"] == "mapped", got
